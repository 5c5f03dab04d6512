"""The Responses API (/v1/responses): request parsing, conversation items, the response
object and its streaming events, the routes."""
