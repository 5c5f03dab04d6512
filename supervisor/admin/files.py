"""`POST /admin/delete {"model": "org/name"}`: delete a model from the Hugging Face cache
(`mlxctl rm`), refusing one a worker serves, is loading or is still stopping.

"Loaded" is judged by directory, not by name: any runner (routed or retiring, in any
state but stopped) whose model lies inside the repo's cache folder, whether it was
loaded as `org/name`, by its snapshot's path, or from another revision the folder holds.
The check and the deletion happen under the pool's admission lock, which every load
holds while it is admitted, so no load can begin between "not loaded" and the files
being gone; a load already past admission is routed, and refused here as loaded. The
whole operation is one shielded task: a client that hangs up does not release the lock
while files are still being deleted. The files go in a thread (a model is many blobs).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web

from supervisor.api.models import LOCAL_MODELS, LocalModels
from supervisor.http.errors import APIError, read_json
from supervisor.keys import POOL
from supervisor.memory import catalog
from supervisor.memory.hf_delete import NotCached, delete_cached, repo_folder
from supervisor.workers.runner import ModelRunner
from supervisor.workers.states import RunnerState


def _user(runners: list[ModelRunner], model: str, folder: Path,
          state_dir: Path) -> ModelRunner | None:
    """The runner whose model is `model` or lies in `folder` (stat calls: a thread)."""
    root = Path(catalog.real(folder))
    for r in runners:
        if r.id == model:
            return r
        found = catalog.target(r.id, state_dir)
        if found is not None and catalog.inside(found.real, [root]):
            return r
    return None


async def _delete(pool, local: LocalModels, model: str, folder: Path) -> tuple[Path, int]:
    async with pool.admission:
        busy = [r for r in pool.all_runners() if r.state != RunnerState.STOPPED]
        user = await asyncio.to_thread(_user, busy, model, folder, pool.config.state_dir)
        if user is not None:
            as_ = "" if user.id == model else f" as `{user.id}`"
            raise APIError(409, f"`{model}` is loaded{as_} ({user.state}): unload it first "
                           f"(`mlxctl unload {user.id}`).", "invalid_request_error", "model",
                           "model_loaded")
        try:
            return await asyncio.to_thread(delete_cached, model)
        except NotCached:
            raise APIError(404, f"`{model}` is not in the Hugging Face cache.",
                           "invalid_request_error", "model", "model_not_found") from None
        finally:
            local.forget()   # the listing rescans the disk, whatever was removed


async def delete(request: web.Request) -> web.Response:
    body = await read_json(request)
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise APIError.bad_request("`model` must be a Hugging Face repo id (org/name).", "model")
    model = model.strip()
    try:
        folder = repo_folder(model)
    except ValueError as e:
        raise APIError.bad_request(f"{e}.", "model") from None
    pool = request.app[POOL]
    path, freed = await asyncio.shield(_delete(pool, request.app[LOCAL_MODELS], model, folder))
    return web.json_response({"model": model, "path": str(path), "freed_bytes": freed})


def setup(router: web.UrlDispatcher, prefix: str) -> None:
    router.add_post(prefix + "/delete", delete)
