// The playground's requests as data: the JSON bodies it sends and the curl command that
// sends the same. Pure functions of the page's settings, so what is shown is what is sent.
"use strict";

const requests = (() => {
  function chatBody(s, messages) {
    const body = {
      model: s.model,
      messages: (s.system ? [{ role: "system", content: s.system }] : []).concat(messages),
      stream: true,
      stream_options: { include_usage: true },
    };
    if (Number.isFinite(s.temperature)) body.temperature = s.temperature;
    if (Number.isFinite(s.maxTokens)) body.max_tokens = s.maxTokens;
    if (s.stop.length) body.stop = s.stop;
    return body;
  }

  function userMessage(text, imageURL) {
    if (!imageURL) return { role: "user", content: text };
    return { role: "user", content: [{ type: "text", text },
                                     { type: "image_url", image_url: { url: imageURL } }] };
  }

  function speechBody(s, text) {
    return { model: s.model, input: text, voice: s.voice || undefined, response_format: "wav" };
  }

  // A data: URL is megabytes of base64: the command shows its size in its place.
  function shorten(body) {
    return JSON.parse(JSON.stringify(body, (k, v) =>
      typeof v === "string" && v.startsWith("data:") && v.length > 80
        ? `${v.slice(0, v.indexOf(",") + 1)}…(${Math.round((v.length * 3) / 4 / 1024)} KB of base64)`
        : v));
  }

  const quote = (s) => "'" + s.replace(/'/g, "'\\''") + "'";

  function auth(hasKey) {
    return hasKey ? ' \\\n  -H "Authorization: Bearer $MLXD_API_KEY"' : "";
  }

  function curlJSON(path, body, hasKey, out) {
    return `curl ${quote(location.origin + path)}${auth(hasKey)} \\\n` +
      "  -H 'Content-Type: application/json' \\\n" +
      `  -d ${quote(JSON.stringify(shorten(body), null, 2))}` +
      (out ? ` \\\n  -o ${out}` : "") + (body.stream ? " \\\n  --no-buffer" : "");
  }

  function curlForm(path, fields, fileName, hasKey) {
    const parts = Object.entries(fields).filter(([, v]) => v)
      .map(([k, v]) => ` \\\n  -F ${quote(`${k}=${v}`)}`).join("");
    return `curl ${quote(location.origin + path)}${auth(hasKey)}${parts} \\\n` +
      `  -F ${quote("file=@" + (fileName || "audio.wav"))}`;
  }

  return { chatBody, userMessage, speechBody, curlJSON, curlForm };
})();
