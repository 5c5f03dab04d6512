"""The browser pages: the dashboard (/ and /ui/) and the playground (/ui/chat)."""
