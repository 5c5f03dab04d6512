"""Conversations API objects as OpenAI's spec shapes them (ConversationResource,
DeletedConversationResource), and its not-found error."""

from __future__ import annotations

from supervisor.api.conversations.store import Conversation
from supervisor.http.errors import APIError


def conversation(conv: Conversation) -> dict:
    return {"id": conv.id, "object": "conversation", "created_at": int(conv.created_at),
            "metadata": conv.metadata}


def deleted(cid: str) -> dict:
    return {"id": cid, "object": "conversation.deleted", "deleted": True}


def not_found(cid: str, param: str) -> APIError:
    return APIError(404, f"Conversation with id '{cid}' not found.", param=param,
                    code="not_found")


def item_not_found(item_id: str) -> APIError:
    return APIError(404, f"Item with id '{item_id}' not found.", param="item_id",
                    code="not_found")
