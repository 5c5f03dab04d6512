"""The admin API (/admin/*, what mlxctl speaks): loopback peers with the token only."""
