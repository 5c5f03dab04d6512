"""The field rules every surface shares, in one place: typed readers and OpenAI-worded
400s (params.py), list and string bounds (limits.py), tools, tool_choice and response
formats (tools.py), images and other media (media.py, remote_media.py), and the parts of
the protocol Generate built with the server's defaults (generate.py). Each surface's
folder parses its own body with these; nothing here imports a surface."""
