// The playground: a chat with a text or vision model (streamed, with Stop), a
// transcription for a speech-to-text model, speech from a text-to-speech one. Every
// request goes to the public API exactly as the curl box shows it; prompts travel in
// request bodies only, never in a URL.
"use strict";

(() => {
  const { el, say } = mlxd;
  const $ = (id) => document.getElementById(id);
  let models = [];          // /v1/models entries
  let history = [];         // this conversation's messages (without the system prompt)
  let controller = null;    // the running request's AbortController
  let image = null;         // {url, name}: the image attached to the next message
  let audio = null;         // {blob, name}: the audio to transcribe
  let recorder = null;      // a running MediaRecorder

  const kindOf = (m) => (m && m.kind) || "text";
  const selected = () => models.find((m) => m.id === $("model").value);
  const mode = () => ({ stt: "stt", tts: "tts", embed: "other", rerank: "other" }[kindOf(selected())] || "chat");

  function settings() {
    const num = (id) => (($(id).value.trim() === "") ? NaN : Number($(id).value));
    return {
      model: $("model").value,
      system: $("system").value.trim(),
      temperature: num("temperature"),
      maxTokens: num("max-tokens"),
      stop: $("stop-sequences").value.split("\n").filter((s) => s.length),
      voice: $("voice").value,
      language: $("language").value.trim(),
    };
  }

  const headers = (json) => mlxd.headers({ json });

  async function errorOf(r) {
    let data = null;
    try { data = await r.json(); } catch (_) { /* not JSON */ }
    return mlxd.errorMessage(r.status, data);
  }

  // ---- the model list -----------------------------------------------------------------
  async function loadModels() {
    try {
      const body = await mlxd.call("GET", "/v1/models");
      models = body.data;
    } catch (e) {
      say(e.status === 401 ? "This server needs an API key: enter it under Settings."
                           : `Could not list the models: ${e.message}`, "error");
      return;
    }
    const keep = $("model").value || sessionStorage.getItem("mlxd.model");
    const option = (m) => el("option", { value: m.id },
      `${m.state === "not_loaded" ? "○" : "●"} ${m.id} (${kindOf(m)}${m.state === "not_loaded" ? ", not loaded" : ""})`);
    $("model").replaceChildren(...models.map(option));
    if (keep && models.some((m) => m.id === keep)) $("model").value = keep;
    onModel();
  }

  function onModel() {
    const m = selected();
    audio = null;
    clearAttachment();
    sessionStorage.setItem("mlxd.model", $("model").value);
    const md = mode();
    $("model-kind").textContent = m ? `${kindOf(m)} · ${m.state}` : "no model";
    $("chat-settings").classList.toggle("hidden", md !== "chat");
    $("tts-settings").classList.toggle("hidden", md !== "tts");
    $("stt-settings").classList.toggle("hidden", md !== "stt");
    $("image-pick").classList.toggle("hidden", kindOf(m) !== "vision");
    $("audio-pick").classList.toggle("hidden", md !== "stt");
    $("record").classList.toggle("hidden", md !== "stt");
    $("prompt").classList.toggle("hidden", md === "stt");
    $("send").textContent = { chat: "Send", stt: "Transcribe", tts: "Speak", other: "Send" }[md];
    $("voice").replaceChildren(...((m && m.voices) || []).map((v) => el("option", { value: v }, v)));
    if (md === "other") say(`${m.id} is a ${kindOf(m)} model: the playground talks to chat, vision and speech models. The curl box shows a request it takes.`);
    showCurl();
  }

  // ---- the curl box ---------------------------------------------------------------------
  function pending() {
    const text = $("prompt").value;
    return history.concat([requests.userMessage(text || "…", image && image.url)]);
  }

  function showCurl() {
    const s = settings();
    const key = !!mlxd.apiKey();
    const md = mode();
    let cmd;
    if (md === "stt") {
      cmd = requests.curlForm("/v1/audio/transcriptions",
        { model: s.model, language: s.language, response_format: "json" }, audio && audio.name, key);
    } else if (md === "tts") {
      cmd = requests.curlJSON("/v1/audio/speech", requests.speechBody(s, $("prompt").value || "…"), key, "speech.wav");
    } else if (md === "other") {
      const kind = kindOf(selected());
      cmd = kind === "embed"
        ? requests.curlJSON("/v1/embeddings", { model: s.model, input: $("prompt").value || "…" }, key)
        : requests.curlJSON("/v1/rerank", { model: s.model, query: "…", documents: ["…", "…"] }, key);
    } else {
      cmd = requests.curlJSON("/v1/chat/completions", requests.chatBody(s, pending()), key);
    }
    $("curl").textContent = cmd;
  }

  // ---- the conversation -----------------------------------------------------------------
  function bubble(role, ...children) {
    const node = el("div", { class: "msg " + role }, ...children);
    $("conversation").append(node);
    $("conversation").scrollTop = $("conversation").scrollHeight;
    return node;
  }

  function running(on) {
    $("send").disabled = on;
    $("stop").disabled = !on;
  }

  function statsLine(t) {
    const parts = [];
    if (t.ttft != null) parts.push(`TTFT ${Math.round(t.ttft * 1000)} ms`);
    if (t.tps != null) parts.push(`${t.tps.toFixed(1)} tok/s`);
    if (t.usage) {
      const cached = (t.usage.prompt_tokens_details || {}).cached_tokens || 0;
      parts.push(`${t.usage.completion_tokens} tokens`,
                 `prompt ${t.usage.prompt_tokens} (${cached} cached)`);
    }
    if (t.finish) parts.push(`finish: ${t.finish}`);
    return el("div", { class: "stats" }, parts.join(" · "));
  }

  async function sendChat() {
    const text = $("prompt").value;
    if (!text.trim() && !image) return;
    const s = settings();
    const user = requests.userMessage(text, image && image.url);
    const body = requests.chatBody(s, history.concat([user]));
    showCurl();
    bubble("user", image ? el("img", { src: image.url, alt: image.name }) : null, text);
    history.push(user);
    $("prompt").value = "";
    clearAttachment();
    const think = el("div", { class: "think hidden" });
    const answer = el("span", { class: "content" });
    const node = bubble("assistant", think, answer);
    controller = new AbortController();
    running(true);
    const t0 = performance.now();
    let tFirst = null;
    let usage = null;
    let finish = null;
    try {
      const r = await fetch("/v1/chat/completions", {
        method: "POST", headers: headers(true), body: JSON.stringify(body), signal: controller.signal,
      });
      if (!r.ok) throw new Error(await errorOf(r));
      for await (const ev of mlxd.sse(r)) {
        if (ev.error) throw new Error(ev.error.message || "the stream ended with an error");
        if (ev.usage) usage = ev.usage;
        const choice = (ev.choices || [])[0];
        if (!choice) continue;
        const d = choice.delta || {};
        if ((d.content || d.reasoning_content) && tFirst === null) tFirst = performance.now();
        if (d.reasoning_content) {
          think.classList.remove("hidden");
          think.textContent += d.reasoning_content;
        }
        if (d.content) answer.textContent += d.content;
        if (choice.finish_reason) finish = choice.finish_reason;
        $("conversation").scrollTop = $("conversation").scrollHeight;
      }
    } catch (e) {
      if (e.name === "AbortError") finish = "stopped";
      else {
        node.classList.add("error");
        answer.textContent += (answer.textContent ? "\n" : "") + e.message;
        finish = "error";
      }
    } finally {
      controller = null;
      running(false);
    }
    const tEnd = performance.now();
    const n = usage ? usage.completion_tokens : null;
    // The decode rate, from the first token to the last; when they came in one burst
    // (a short reply) that span says nothing, and the whole request's time is used.
    const span = tFirst !== null && tEnd - tFirst >= 50 ? tEnd - tFirst : tEnd - t0;
    const counted = span === tEnd - t0 ? n : n - 1;
    node.append(statsLine({
      ttft: tFirst === null ? null : (tFirst - t0) / 1000,
      tps: n > 1 && span > 0 ? counted / (span / 1000) : null,
      usage, finish,
    }));
    node.dataset.finish = finish || "";
    // A stopped reply stays in the conversation as far as it got, as the model wrote it.
    // (The curl box keeps the request just sent until the next one is typed.)
    if (finish !== "error") history.push({ role: "assistant", content: answer.textContent });
  }

  // A request with one answer (speech, a transcription): `show` puts the answer in its
  // bubble; an error says why there is none; Stop aborts it.
  async function exchange(node, path, init, show) {
    controller = new AbortController();
    running(true);
    const t0 = performance.now();
    try {
      const r = await fetch(path, { method: "POST", signal: controller.signal, ...init });
      if (!r.ok) throw new Error(await errorOf(r));
      await show(r, () => (performance.now() - t0) / 1000);
      node.dataset.finish = "stop";
    } catch (e) {
      const stopped = e.name === "AbortError";
      node.classList.toggle("error", !stopped);
      node.textContent = stopped ? "stopped" : e.message;
      node.dataset.finish = stopped ? "stopped" : "error";
    } finally {
      controller = null;
      running(false);
    }
  }

  async function sendSpeech() {
    const text = $("prompt").value.trim();
    if (!text) return;
    const body = requests.speechBody(settings(), text);
    bubble("user", text);
    $("prompt").value = "";
    const node = bubble("assistant", "speaking…");
    await exchange(node, "/v1/audio/speech", { headers: headers(true), body: JSON.stringify(body) },
      async (r, took) => {
        const blob = await r.blob();
        const player = el("audio", { controls: true, src: URL.createObjectURL(blob) });
        const stats = el("div", { class: "stats" },
          `${mlxd.bytes(blob.size)} of WAV in ${took().toFixed(2)} s`);
        player.addEventListener("loadedmetadata", () => {
          stats.textContent += ` · ${player.duration.toFixed(2)} s of audio`;
        });
        node.replaceChildren(player, stats);
      });
  }

  async function sendAudio() {
    if (!audio) {
      say("Choose an audio file or record one first.", "error");
      return;
    }
    const s = settings();
    const form = new FormData();
    form.append("model", s.model);
    form.append("response_format", "verbose_json");
    if (s.language) form.append("language", s.language);
    form.append("file", audio.blob, audio.name);
    bubble("user", `Audio: ${audio.name} (${mlxd.bytes(audio.blob.size)})`);
    audio = null;   // sent: the next transcription takes a new file or recording
    $("audio").value = "";
    $("attached").textContent = "";
    const node = bubble("assistant", "transcribing…");
    await exchange(node, "/v1/audio/transcriptions", { headers: headers(false), body: form },
      async (r, took) => {
        const t = await r.json();
        node.replaceChildren(el("span", { class: "content" }, t.text || "(no speech found)"),
          el("div", { class: "stats" },
            `${t.language || "?"} · ${(t.duration || 0).toFixed(2)} s of audio in ${took().toFixed(2)} s`));
      });
  }

  // ---- attachments ----------------------------------------------------------------------
  function clearAttachment() {
    image = null;
    $("image").value = "";
    $("attached").textContent = audio ? `${audio.name}, ${mlxd.bytes(audio.blob.size)}` : "";
  }

  $("image").addEventListener("change", () => {
    const file = $("image").files[0];
    if (!file) return clearAttachment();
    const reader = new FileReader();
    reader.onload = () => {
      image = { url: reader.result, name: file.name };
      $("attached").textContent = `${file.name}, ${mlxd.bytes(file.size)}`;
      showCurl();
    };
    reader.readAsDataURL(file);
  });

  $("audio").addEventListener("change", () => {
    const file = $("audio").files[0];
    audio = file ? { blob: file, name: file.name } : null;
    $("attached").textContent = file ? `${file.name}, ${mlxd.bytes(file.size)}` : "";
    showCurl();
  });

  $("record").addEventListener("click", async () => {
    if (recorder) {
      recorder.stop();
      return;
    }
    let stream;
    try {
      stream = await navigator.mediaDevices.getUserMedia({ audio: true });
    } catch (e) {
      say(`No microphone: ${e.message}`, "error");
      return;
    }
    const chunks = [];
    recorder = new MediaRecorder(stream);
    recorder.ondataavailable = (ev) => chunks.push(ev.data);
    recorder.onstop = () => {
      stream.getTracks().forEach((t) => t.stop());
      const type = recorder.mimeType || "audio/webm";
      const ext = type.includes("ogg") ? "ogg" : type.includes("mp4") ? "m4a" : "webm";
      audio = { blob: new Blob(chunks, { type }), name: `recording.${ext}` };
      recorder = null;
      $("record").textContent = "Record";
      $("attached").textContent = `${audio.name}, ${mlxd.bytes(audio.blob.size)}`;
      showCurl();
    };
    recorder.start();
    $("record").textContent = "Stop recording";
    $("attached").textContent = "recording…";
  });

  // ---- wiring ---------------------------------------------------------------------------
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    if (controller) return;
    say("");
    ({ chat: sendChat, tts: sendSpeech, stt: sendAudio, other: () => {} })[mode()]();
  });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("clear").addEventListener("click", () => {
    history = [];
    $("conversation").replaceChildren();
    clearAttachment();
    showCurl();
  });
  $("model").addEventListener("change", onModel);
  $("refresh").addEventListener("click", loadModels);
  $("api-key").value = mlxd.apiKey();
  $("api-key").addEventListener("change", () => {
    mlxd.setApiKey($("api-key").value.trim());
    loadModels();
  });
  for (const id of ["prompt", "system", "temperature", "max-tokens", "stop-sequences", "voice", "language"]) {
    $(id).addEventListener("input", showCurl);
  }
  loadModels();
})();
