"""mlxctl's human output: aligned tables and sizes. (`--json` prints the server's JSON.)"""

from __future__ import annotations


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def human_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def table(header: tuple[str, ...], rows: list[tuple]) -> str:
    cells = [tuple(header), *(tuple("-" if c is None else str(c) for c in r) for r in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip()
                     for r in cells)


def format_status(body: dict) -> str:
    head = f"status: {body.get('status', '?')}"
    if body.get("reason"):
        head += f" ({body['reason']})"
    lines = [head]
    server = body.get("server") or {}
    if server:
        lines.append(f"server: pid {server.get('pid')}, up {human_seconds(server.get('uptime_s'))}, "
                     f"RSS {human_bytes(server.get('rss_bytes'))}, version {server.get('version')}")
    mem = body.get("memory")
    if mem:
        pressure = mem.get("pressure") or "n/a"
        lines.append(f"memory: {human_bytes(mem.get('available_bytes'))} available of "
                     f"{human_bytes(mem.get('total_bytes'))}, pressure {pressure}")
    rows = []
    for w in body.get("workers", []):
        cache = w.get("prompt_cache") or {}
        lookups = cache.get("hits", 0) + cache.get("misses", 0)
        state = w["state"]
        if w.get("load_progress") is not None:
            state += f"({w['load_progress']:.0%})"  # converting a GGUF
        elif w.get("progress") is not None:
            state += f"({w['progress']:.0%})"  # a transcription's audio done so far
        rows.append((w["model"], w.get("kind") or "-", state, w.get("pid"), human_seconds(w.get("uptime_s")),
                     human_bytes(w.get("rss_bytes")), human_bytes(w.get("active_bytes")),
                     human_bytes(w.get("peak_bytes")), w.get("queued", 0), w.get("in_flight", 0),
                     f"{w.get('tokens_per_s', 0.0):.1f}",
                     f"{cache.get('hits', 0)}/{lookups}" if cache else "-",
                     human_bytes(cache.get("bytes")) if cache else "-", _snapshots(cache),
                     *_kv(w.get("kv")), _drafts(w.get("speculation")), w.get("restarts", 0)))
    if rows:
        lines.append(table(("MODEL", "KIND", "STATE", "PID", "UPTIME", "RSS", "MLX ACTIVE", "MLX PEAK",
                            "QUEUED", "IN-FLIGHT", "TOK/S (1m)", "CACHE HITS", "CACHE MEM",
                            "RESUMED RAM/DISK", "KV/TOKEN", "KV TOKENS", "DRAFTS OK, TOK/VERIFY",
                            "RESTARTS"), rows))
    else:
        lines.append("no model loaded")
    for w in body.get("workers", []):
        if w.get("group"):
            lines += format_group(w["model"], w["group"])
    return "\n".join(lines)


def _kv(kv: dict | None) -> tuple[str, str]:
    """The worker's KV memory: bytes one token of context takes, with its format (q8, q4:
    --kv-bits; none: full precision), and the tokens of context its batch and prompt
    cache hold now."""
    if not kv:
        return "-", "-"
    per = human_bytes(round(kv["bytes_per_token"]))
    return (f"{per} q{kv['bits']}" if kv.get("bits") else per), f"{kv['tokens']:,}"


def _drafts(spec: dict | None) -> str:
    """Speculative decoding: the share of drafted tokens accepted, tokens per verification."""
    if not spec or not spec.get("verifications"):
        return "-"
    return f"{spec['acceptance']:.0%}, {spec['tokens_per_verification']:.2f}"


def format_group(model: str, group: dict) -> list[str]:
    """A worker group's ranks (worker/group/): where each runs and what it holds, and the
    link its collectives measured at start."""
    link = (f"link: all-reduce {group.get('latency_s', 0) * 1e6:.0f} us, "
            f"{group.get('bandwidth_bytes_s', 0) / 1e9:.2f} GB/s")
    rows = [(r["rank"], r["host"], r["pid"], human_bytes(r.get("free_bytes")),
             human_bytes(r.get("active_bytes")), human_bytes(r.get("peak_bytes")))
            for r in group.get("ranks", [])]
    return [f"{model}: a group of {group['size']} ({group['sharding']} parallel over "
            f"{group['backend']}); {link}",
            table(("RANK", "HOST", "PID", "FREE AT LOAD", "MLX ACTIVE", "MLX PEAK"), rows)]


def _snapshots(cache: dict) -> str:
    """Requests resumed from a named KV snapshot in memory / on disk (mlxctl cache ls
    lists the snapshots)."""
    snap = cache.get("snapshots")
    return f"{snap['hits_ram']}/{snap['hits_disk']}" if snap else "-"


def format_models(body: dict) -> str:
    rows = [(m["id"], human_bytes(m.get("size_bytes")), m.get("context_length"),
             m.get("state"), m.get("source")) for m in body.get("models", [])]
    if not rows:
        return ("no local MLX models: `mlxctl pull mlx-community/MODEL` downloads one "
                "into the Hugging Face cache")
    return table(("MODEL", "SIZE", "CONTEXT", "STATE", "SOURCE"), rows)


def format_cache(body: dict, now: float) -> str:
    """`mlxctl cache ls`: each model's KV snapshots, most recently used first."""
    rows, errors = [], []
    for m in body.get("models", []):
        if "error" in m:
            errors.append(f"{m['model']}: {m['error']}")
        for s in m.get("snapshots", []):
            rows.append((m["model"], s["name"], s["tokens"],
                         human_bytes(s["ram_bytes"]) if s["ram_bytes"] else "-",
                         human_bytes(s["disk_bytes"]) if s["disk_bytes"] else "-",
                         human_seconds(now - s["used_at"]) + " ago"))
    lines = [table(("MODEL", "NAME", "TOKENS", "MEMORY", "DISK", "USED"), rows)] if rows else [
        "no KV snapshots (a stored response, or a request with a prompt_cache_key, keeps one)"]
    return "\n".join(lines + errors)
