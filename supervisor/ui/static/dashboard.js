// The dashboard: polls the server once a second and redraws. With the admin token it
// reads /admin/status (memory, RSS, limits) and the log, and its buttons call the admin
// API; without it, /health (open to all) still shows the models and their load, and the
// buttons' calls come back refused, which the message line says.
"use strict";

(() => {
  const { el, call, bytes, duration, rate, say } = mlxd;
  const POLL_MS = 1000;
  const LOG_EVERY = 3;      // polls between log reads
  const MODELS_EVERY = 10;  // polls between reads of the local models' list

  mlxd.takeFragmentToken();
  const chart = new LiveChart(document.getElementById("chart"), { unit: " tok/s" });
  const $ = (id) => document.getElementById(id);
  let previous = null;      // {t, total}: the last poll's token count, for the chart's rate
  let tick = 0;
  let refused = null;       // the admin API's refusal of the token, if it refused it
  let told = null;          // the refusal the message line last said (said once, not each poll)
  let busy = false;         // an action is running: its message stays until it ends

  async function readStatus() {
    refused = null;
    if (mlxd.adminToken()) {
      try {
        return { admin: true, ...(await call("GET", "/admin/status", undefined, { admin: true })) };
      } catch (e) {
        if (e.status !== 401 && e.status !== 403) throw e;
        refused = e.message;
      }
    }
    // /health answers 503 with the same body shape when no model can serve.
    const h = await call("GET", "/health", undefined, { okStatuses: [503] });
    return { admin: false, status: h.status, reason: h.reason, workers: h.workers || [] };
  }

  const STATUS_CLASS = { ok: "ok", idle: "muted", degraded: "warn", unavailable: "bad" };
  const STATE_CLASS = { ready: "ok", starting: "warn", restarting: "warn", draining: "warn",
                        failed: "bad", stopped: "muted" };

  function fact(k, v, title) {
    return el("div", { class: "fact", title }, el("div", { class: "k" }, k),
              el("div", { class: "v" }, v));
  }

  function causes(w) {
    const list = Object.entries(w.restart_causes || {}).map(([c, n]) => `${c} ×${n}`);
    return list.join(", ");
  }

  function hitRate(pc) {
    if (!pc) return ["–", "no prompt cache"];
    const asked = pc.hits + pc.misses;
    if (!asked) return ["–", "no lookups yet"];
    return [Math.round((100 * pc.hits) / asked) + "%",
            `${pc.hits} hits, ${pc.misses} misses, ${pc.tokens_reused} prompt tokens reused, ` +
            `${bytes(pc.bytes)} held in ${pc.entries} entries`];
  }

  function kvHeld(kv) {
    if (!kv) return ["–", "no KV cache"];
    const format = kv.bits ? `${kv.bits}-bit` : "full precision";
    return [`${bytes(Math.round(kv.bytes_per_token))} · ${kv.tokens}`,
            `${format} KV: ${bytes(Math.round(kv.bytes_per_token))} per token of context; ` +
            `${kv.tokens} tokens (${bytes(kv.bytes)}) held by the batch and the prompt cache`];
  }

  function drafts(sp) {
    if (!sp || !sp.verifications) return ["–", sp ? "no drafts verified yet" : "no speculation"];
    return [`${Math.round(100 * sp.acceptance)}% · ${sp.tokens_per_verification.toFixed(2)}`,
            `${sp.accepted} of ${sp.drafted} drafted tokens accepted; ` +
            `${sp.tokens_per_verification.toFixed(2)} tokens per verification step ` +
            `(${sp.verifications} verifications)`];
  }

  function actions(w) {
    if (w.state === "stopped") return el("td");
    return el("td", {},
      el("button", { class: "unload", title: "finish running requests, then unload", disabled: busy,
                     onclick: () => act("unload", { model: w.model, mode: "drain" }) }, "Unload"),
      " ",
      el("button", { class: "danger kill", title: "cancel everything on it and restart it",
                     disabled: busy,
                     onclick: () => act("kill", { model: w.model, restart: true }) }, "Kill"));
  }

  function workerRow(w) {
    const [hits, hitsTitle] = hitRate(w.prompt_cache);
    const [draft, draftTitle] = drafts(w.speculation);
    const [kv, kvTitle] = kvHeld(w.kv);
    const state = w.state + (w.progress != null ? ` ${Math.round(100 * w.progress)}%` : "") +
      (w.load_progress != null ? ` ${Math.round(100 * w.load_progress)}%` : "");
    return el("tr", { "data-model": w.model },
      el("td", { class: "model mono", title: w.model }, w.model),
      el("td", {}, w.kind || "–"),
      el("td", { title: w.last_error || "" },
         el("span", { class: "badge " + (STATE_CLASS[w.state] || "") }, state)),
      el("td", { class: "num" }, w.pid ?? "–"),
      el("td", { class: "num" }, bytes(w.rss_bytes)),
      el("td", { class: "num" }, bytes(w.active_bytes)),
      el("td", { class: "num" }, bytes(w.peak_bytes)),
      el("td", { class: "num", title: `${w.queued} queued here, ${w.waiting} accepted and not started` },
         String(w.waiting ?? w.queued)),
      el("td", { class: "num", title: "sequences in the worker's batch / its slots" },
         `${w.worker_active ?? 0}/${w.slots ?? "–"}`),
      el("td", { class: "num tps", title: "completion tokens per second, mean of the last minute" },
         rate(w.tokens_per_s)),
      el("td", { class: "num", title: hitsTitle }, hits),
      el("td", { class: "num kv", title: kvTitle }, kv),
      el("td", { class: "num", title: draftTitle }, draft),
      el("td", { class: "restarts", title: causes(w) }, String(w.restarts) + (w.restarts ? ` (${causes(w)})` : "")),
      actions(w));
  }

  function render(s) {
    const badge = $("status");
    badge.textContent = s.status + (s.reason ? ` — ${s.reason}` : "");
    badge.className = "badge " + (STATUS_CLASS[s.status] || "");
    const workers = s.workers || [];
    $("workers").tBodies[0].replaceChildren(...workers.map(workerRow));
    if (!workers.length) {
      $("workers").tBodies[0].append(el("tr", {}, el("td", { colspan: 14, class: "muted" },
        "No model is loaded.")));
    }
    const total = workers.reduce((n, w) => n + (w.tokens_total || 0), 0);
    const now = performance.now() / 1000;
    // Between two polls: the live rate (tokens_per_s in the table is a minute's mean).
    if (previous) chart.push(Math.max(0, total - previous.total) / Math.max(now - previous.t, 0.2));
    previous = { t: now, total };
    const inFlight = workers.reduce((n, w) => n + (w.in_flight || 0), 0);
    const facts = [
      fact("models loaded", String(workers.filter((w) => w.state !== "stopped").length)),
      fact("requests running", String(inFlight)),
      fact("tok/s (1 min)", rate(workers.reduce((n, w) => n + (w.tokens_per_s || 0), 0))),
    ];
    if (s.admin) {
      facts.push(fact("uptime", duration(s.server.uptime_s)),
                 fact("version", s.server.version),
                 fact("supervisor RSS", bytes(s.server.rss_bytes)),
                 fact("max models", s.limits.max_models ? String(s.limits.max_models) : "memory decides"),
                 fact("memory budget", s.limits.memory_budget ? bytes(s.limits.memory_budget) : "what is free"));
    }
    $("facts").replaceChildren(...facts);
    const m = s.memory;
    $("memory").replaceChildren(...(m ? [
      fact("available", bytes(m.available_bytes)),
      fact("total", bytes(m.total_bytes)),
      fact("used", Math.round(100 * (1 - m.available_bytes / m.total_bytes)) + "%"),
      fact("pressure", m.pressure || "n/a", m.pressure ? m.source : "this OS gives no pressure signal"),
    ] : [el("p", { class: "muted" }, "Needs the admin token.")]));
    $("admin-note").classList.toggle("hidden", !!s.admin);
  }

  async function readLog() {
    const log = $("log");
    const atEnd = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
    const body = await call("GET", "/admin/logs?lines=200", undefined, { admin: true });
    log.textContent = body.lines.length ? body.lines.join("\n") : "(the log is empty)";
    if (atEnd) log.scrollTop = log.scrollHeight;
  }

  async function readModels() {
    // The admin's list has every local model; /v1/models those a request may load.
    let ids = [];
    try {
      if (mlxd.adminToken()) {
        const body = await call("GET", "/admin/models", undefined, { admin: true });
        ids = body.models.filter((m) => m.state === "not_loaded").map((m) => m.id);
      } else {
        const body = await call("GET", "/v1/models");
        ids = body.data.filter((m) => m.state === "not_loaded").map((m) => m.id);
      }
    } catch (_) { /* refused or an API key is needed: the field still takes any name */ }
    $("local-models").replaceChildren(...ids.map((id) => el("option", { value: id })));
  }

  async function poll() {
    try {
      const s = await readStatus();
      render(s);
      if (refused && refused !== told && !busy) say(`The admin token was refused: ${refused}`, "error");
      told = refused;
      if (s.admin && tick % LOG_EVERY === 0) await readLog();
      if (tick % MODELS_EVERY === 0) await readModels();
    } catch (e) {
      $("status").textContent = "server not reachable";
      $("status").className = "badge bad";
    }
    tick++;
    setTimeout(poll, POLL_MS);
  }

  const WHAT = { load: "loading", swap: "swapping to", unload: "unloading", kill: "killing" };

  // An admin action. Without the token (or with a wrong one) the server refuses it and the
  // message line shows its answer: the page never pretends.
  async function act(verb, body) {
    busy = true;
    document.querySelectorAll("button").forEach((b) => (b.disabled = true));
    say(`${WHAT[verb]} ${body.model || "every model"}…`);
    try {
      const r = await call("POST", "/admin/" + verb, body, { admin: true });
      const done = {
        load: () => `${r.model}: ${r.state} (context ${r.context_length})`,
        swap: () => `swapped to ${r.model} in ${r.seconds.toFixed(1)} s`,
        unload: () => `${r.model}: unloaded`,
        kill: () => r.killed.map((k) => `${k.model}: killed, ${k.cancelled} cancelled`).join("; "),
      }[verb]();
      say(done, "done");
    } catch (e) {
      const hint = e.status === 401 ? " Enter the admin token above (or open the page with `mlxctl ui`)." : "";
      say(`${verb} failed: ${e.message}${hint}`, "error");
      if (e.status === 401) $("token").focus();
    } finally {
      busy = false;
      document.querySelectorAll("button").forEach((b) => (b.disabled = false));
    }
  }

  $("token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    mlxd.setAdminToken($("token").value.trim());
    $("token").value = "";
    say(mlxd.adminToken() ? "Admin token kept for this tab." : "Admin token cleared.", "done");
    tick = 0;
  });
  $("forget").addEventListener("click", () => {
    mlxd.setAdminToken("");
    say("Admin token forgotten.", "done");
    $("log").textContent = "The log needs the admin token.";
  });
  $("load-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const model = $("load-model").value.trim();
    if (model) act("load", { model });
    else say("Name a model to load.", "error");
  });
  $("swap").addEventListener("click", () => {
    const model = $("load-model").value.trim();
    if (model) act("swap", { model, mode: "drain" });
    else say("Name a model to swap to.", "error");
  });

  poll();
})();
