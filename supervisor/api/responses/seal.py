"""A compaction item's `encrypted_content`: what the model wrote about a conversation,
sealed so that only the server that wrote it can read it and vouch for it. A reasoning
item's too, when a request includes `reasoning.encrypted_content`: its text sealed under
the same key (another associated data: one kind never opens as the other), so that a
client that keeps no state and sends back only what it cannot read (the Vercel AI SDK
with `store: false` drops every reasoning item without it) gives the model its reasoning
again; one that does not open (another server's: a conversation moved here from
OpenAI) is left out of the prompt, as reasoning without text is, not refused.

What the client can read: nothing but its length. The content is `mlxd1.` and, in
base64url, a random 96-bit nonce, then AES-256-GCM (the `cryptography` package) over a
JSON payload: the summary the model wrote and, for a compaction that `context_management`
made inside a response, the conversation items it kept word for word (the turn in
progress). The key is derived (HKDF-SHA256) from a 256-bit secret in the state directory,
`compaction-key` (mode 0600, made on first start like the admin token).

What the server vouches for: the GCM tag covers every byte, so an edited item, a forged
one and one that another mlxd instance made (another state directory: another key) do not
open, and a request carrying one is a 400 `invalid_encrypted_content` naming the item,
never a 500 and never a prompt built from text the client chose while claiming to be
the server's. Deleting the key file retires every compaction item made before.

`expand` is where a compaction item becomes prompt: in its place in the conversation,
a user message holding the summary, then the items it kept; the items after it follow.
The one a response made for itself (`context_management`) holds the turn in progress and
stands for everything before it, so what precedes it is dropped. The one that
POST /v1/responses/compact returns comes after the user messages it leaves in the clear.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import os
from pathlib import Path

from aiohttp import web
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from supervisor.admin.token import ensure_secret
from supervisor.api.responses.items import new_id
from supervisor.http.errors import APIError
from supervisor.keys import CONFIG

KEY_FILE = "compaction-key"
PREFIX = "mlxd1."
_AAD = b"mlxd responses compaction item v1"
_REASONING_AAD = b"mlxd responses reasoning item v1"
_NONCE = 12
# How the summary stands in the prompt: the model reads it as the conversation so far.
SUMMARY_HEADER = ("[The earlier part of this conversation was compacted. "
                  "Summary of it:]\n")


class Sealer:
    def __init__(self, secret: str):
        key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                   info=b"mlxd compaction key").derive(secret.encode())
        self._aead = AESGCM(key)

    @classmethod
    def of_state_dir(cls, state_dir: Path) -> "Sealer":
        """The sealer of the key in `state_dir` (made there if missing)."""
        return cls(ensure_secret(Path(state_dir) / KEY_FILE))

    def seal(self, summary: str, kept: list | tuple = (), whole: bool = False) -> str:
        return self._seal({"summary": summary, "kept": list(kept), "whole": whole}, _AAD)

    def open(self, content: str) -> dict | None:
        """The payload ({"summary", "kept", "whole"}), or None when `content` is not one
        this key sealed (edited, forged, another instance's, or not ours at all)."""
        return self._open(content, _AAD)

    def seal_reasoning(self, text: str) -> str:
        return self._seal({"reasoning": text}, _REASONING_AAD)

    def open_reasoning(self, content: str) -> str | None:
        """A sealed reasoning item's text, or None (as `open`)."""
        payload = self._open(content, _REASONING_AAD)
        return None if payload is None else payload["reasoning"]

    def _seal(self, payload: dict, aad: bytes) -> str:
        nonce = os.urandom(_NONCE)
        plain = json.dumps(payload, separators=(",", ":")).encode()
        return PREFIX + base64.urlsafe_b64encode(
            nonce + self._aead.encrypt(nonce, plain, aad)).decode()

    def _open(self, content: str, aad: bytes) -> dict | None:
        if not isinstance(content, str) or not content.startswith(PREFIX):
            return None
        try:
            raw = base64.urlsafe_b64decode(content[len(PREFIX):].encode("ascii"))
            plain = self._aead.decrypt(raw[:_NONCE], raw[_NONCE:], aad)
        except (binascii.Error, ValueError, InvalidTag, UnicodeEncodeError):
            return None
        return json.loads(plain)

    def item(self, summary: str, kept: list | tuple = (), whole: bool = False) -> dict:
        """A new compaction item (CompactionBody) holding `summary` and `kept`; `whole`:
        it stands for the whole conversation before it."""
        return {"id": new_id("cmp"), "type": "compaction",
                "encrypted_content": self.seal(summary, kept, whole)}


def refused(item: dict) -> APIError:
    return APIError.bad_request(
        f"The encrypted content of compaction item '{item.get('id') or '(no id)'}' could not "
        "be verified: it was not made by this server, or it was changed.", "input",
        "invalid_encrypted_content")


def summary_message(item_id: str, summary: str) -> dict:
    return {"id": item_id, "type": "message", "role": "user", "status": "completed",
            "content": [{"type": "input_text", "text": SUMMARY_HEADER + summary}]}


def expand(items: list[dict], sealer: Sealer) -> list[dict]:
    """Conversation items → the items the prompt is built from: each compaction item, in
    its place, becomes its summary (a user message) followed by the items it kept; one
    that stands for the whole conversation before it (made by `context_management` in a
    response's output) drops what came before it, wherever the conversation comes from (a
    stored chain, a conversation, a client's own history). 400 on one that does not open.
    A reasoning item that holds its text only sealed gets it back (the module's doc)."""
    out = []
    for item in items:
        if item.get("type") == "reasoning":
            out.append(_opened(item, sealer))
            continue
        if item.get("type") != "compaction":
            out.append(item)
            continue
        payload = sealer.open(item.get("encrypted_content"))
        if payload is None:
            raise refused(item)
        if payload["whole"]:
            out = []
        out.append(summary_message(item.get("id") or new_id("cmp"), payload["summary"]))
        out.extend(payload["kept"])
    return out


def _opened(item: dict, sealer: Sealer) -> dict:
    """A reasoning item with its text: as it came, or from its `encrypted_content` where
    it carries no text of its own and the content is one this server sealed."""
    if any(p.get("text") for p in (item.get("content") or []) + (item.get("summary") or [])):
        return item
    text = sealer.open_reasoning(item.get("encrypted_content"))
    if text is None:
        return item
    return {**item, "content": [{"type": "reasoning_text", "text": text}]}


SEALER = web.AppKey("compaction_sealer", Sealer)


def setup(app: web.Application) -> None:
    """The key is read (or made) once, at start-up."""
    async def load(app: web.Application) -> None:
        app[SEALER] = await asyncio.to_thread(Sealer.of_state_dir, app[CONFIG].state_dir)
    app.on_startup.append(load)
