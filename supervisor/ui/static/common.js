// mlxd pages: what the dashboard and the playground share. No framework, no build step:
// plain DOM, fetch and session storage.
"use strict";

const mlxd = (() => {
  const ADMIN = "mlxd.adminToken";
  const API = "mlxd.apiKey";
  // Session storage only: the token lives as long as the tab, never on disk in the
  // browser's profile, and never in a URL the server sees.
  const store = window.sessionStorage;

  // `mlxctl ui` opens the dashboard as /#token=...: a fragment is never sent to a server
  // nor kept in a Referer. Take it into session storage and drop it from the address bar.
  function takeFragmentToken() {
    const m = /(?:^#|&)token=([^&]+)/.exec(location.hash);
    if (m) {
      store.setItem(ADMIN, decodeURIComponent(m[1]));
      history.replaceState(null, "", location.pathname + location.search);
    }
  }

  const get = (k) => store.getItem(k) || "";
  const put = (k, v) => (v ? store.setItem(k, v) : store.removeItem(k));

  class HTTPError extends Error {
    constructor(status, message, body) {
      super(message);
      this.status = status;
      this.body = body;
    }
  }

  // A request's headers: the admin token (`admin`), otherwise the API key if one was
  // typed; a JSON content type when it carries JSON.
  function headers({ json = false, admin = false } = {}) {
    const h = json ? { "Content-Type": "application/json" } : {};
    const secret = admin ? get(ADMIN) : get(API);
    if (secret) h["Authorization"] = "Bearer " + secret;
    return h;
  }

  // The server's own message from an error answer's envelope (the body read as JSON).
  function errorMessage(status, data) {
    return (data && data.error && data.error.message) || `HTTP ${status}`;
  }

  // A JSON call. An error answer throws HTTPError with the server's message.
  async function call(method, path, body, { admin = false, signal, okStatuses = [] } = {}) {
    const r = await fetch(path, {
      method, signal, cache: "no-store", headers: headers({ json: body !== undefined, admin }),
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    let data = null;
    try { data = await r.json(); } catch (_) { /* not JSON */ }
    if (!r.ok && !okStatuses.includes(r.status)) {
      throw new HTTPError(r.status, errorMessage(r.status, data), data);
    }
    return data;
  }

  // Build an element: el("td", {class: "num", title: "x"}, "text", child, ...). Text is
  // always text (textContent), never markup: nothing a model writes becomes HTML.
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "class") node.className = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else if (k in node && typeof v !== "string") node[k] = v;
      else node.setAttribute(k, v === true ? "" : v);
    }
    for (const c of children.flat()) {
      if (c === undefined || c === null || c === false) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  }

  function bytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KB", "MB", "GB", "TB"];
    let i = 0;
    let v = n;
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return (i === 0 ? v : v.toFixed(v < 10 ? 2 : 1)) + " " + units[i];
  }

  function duration(s) {
    if (s === null || s === undefined) return "–";
    if (s < 60) return Math.round(s) + " s";
    if (s < 3600) return Math.floor(s / 60) + " min " + Math.round(s % 60) + " s";
    const h = Math.floor(s / 3600);
    return h + " h " + Math.floor((s % 3600) / 60) + " min";
  }

  function rate(v) {
    return v === null || v === undefined ? "–" : v.toFixed(v < 10 ? 2 : 1);
  }

  // The SSE events of a fetch() answer, as parsed JSON `data:` payloads ("[DONE]" ends).
  async function* sse(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
        const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }

  // The message line under the header: what the last action did.
  function say(text, kind) {
    const m = document.getElementById("message");
    if (!m) return;
    m.textContent = text;
    m.className = kind || "";
  }

  return {
    takeFragmentToken, HTTPError, headers, errorMessage, call, el, bytes, duration, rate, sse, say,
    adminToken: () => get(ADMIN), setAdminToken: (v) => put(ADMIN, v),
    apiKey: () => get(API), setApiKey: (v) => put(API, v),
  };
})();
