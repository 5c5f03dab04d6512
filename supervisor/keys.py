"""Typed application keys: the app's shared state."""

from aiohttp import web

from supervisor.config import Config
from supervisor.workers.pool import Pool

CONFIG = web.AppKey("config", Config)
POOL = web.AppKey("pool", Pool)
