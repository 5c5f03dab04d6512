"""Service templates: the launchd LaunchAgent (macOS) and the systemd user unit (Linux).

A package only so the templates ship inside the wheel; `mlxctl/service.py` renders
them (importlib.resources finds them in an editable checkout and an installed wheel alike).
"""
