"""`mlxctl pull MODEL` and `mlxctl rm MODEL`: models in and out of the Hugging Face cache.

A pull lists the repo's files with their sizes first (one API call), keeps those
mlx-lm's loader reads (`PULL_PATTERNS`; with `--gguf FILE`, that one file), skips those
the cache holds complete, and fetches the rest resumably (mlxctl/resumable.py:
a partial file is continued with an HTTP Range, after a dropped connection within one
pull and after an interrupted pull on the next) into huggingface_hub's own cache layout,
the one the server and mlx-lm read. Progress goes through mlxctl/progress.py.
`HF_ENDPOINT` and `HF_TOKEN` work as for every huggingface_hub client.

`rm` deletes the repo's folder from the cache. With the server running it asks the
server (`POST /admin/delete`), which refuses a model it has loaded and keeps a load from
starting meanwhile; with no server running nothing can be loaded, and mlxctl deletes it
itself. Both go through supervisor/memory/hf_delete.py.
"""

from __future__ import annotations

import fnmatch
import json
import sys
from pathlib import Path

from mlxctl.connection import (EXIT_INTERRUPTED, EXIT_OK, EXIT_UNHEALTHY, EXIT_USAGE,
                               ServerDown, emit)
from mlxctl.format import human_bytes
from mlxctl.progress import Progress, bar_class

# The files mlx-lm's loader uses (mlx_lm.utils.DEFAULT_ALLOW_PATTERNS): a worker finds a
# pulled model complete in the cache without ever downloading.
PULL_PATTERNS = ["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken",
                 "tiktoken.model", "*.txt", "*.jsonl", "*.jinja"]


class Hub:
    """The Hugging Face calls a pull makes (tests replace it, or point HF_ENDPOINT at a
    local server that speaks the same API)."""

    def files(self, repo: str, revision: str | None) -> tuple[str, list[tuple[str, int | None]]]:
        """(the commit `revision` names, [(file, size)])."""
        from huggingface_hub import HfApi

        info = HfApi().model_info(repo, revision=revision, files_metadata=True)
        return info.sha, [(s.rfilename, s.size) for s in info.siblings or []]

    def cached(self, repo: str, filename: str, commit: str) -> str | None:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo, filename, revision=commit)
        return found if isinstance(found, str) else None

    def download(self, repo: str, filename: str, revision: str | None, bar) -> str:
        """The file's path in the cache. The bytes come through mlxctl/
        resumable.py (resumed across pulls); huggingface_hub then links the blob into
        the snapshot as it does its own downloads."""
        from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
        from huggingface_hub.utils import build_hf_headers

        from mlxctl.resumable import blob_path, fetch, same_origin

        url = hf_hub_url(repo, filename, revision=revision)
        meta = get_hf_file_metadata(url)
        if not meta.etag:   # nothing to name the blob by: huggingface_hub's own way
            return hf_hub_download(repo, filename, revision=revision, tqdm_class=bar)
        headers = build_hf_headers()
        if not same_origin(url, meta.location):
            headers.pop("authorization", None)
        fetch(meta.location, blob_path(repo, meta.etag), meta.size, meta.etag, bar, headers)
        return hf_hub_download(repo, filename, revision=revision)


def wanted(files: list[tuple[str, int | None]], gguf: str | None) -> list[tuple[str, int | None]]:
    if gguf is not None:
        return [f for f in files if f[0] == gguf]
    return [f for f in files if any(fnmatch.fnmatch(f[0], p) for p in PULL_PATTERNS)]


def _fail(args, message: str, code: int = EXIT_UNHEALTHY) -> int:
    """One line on stderr; with --json, the stream on stdout ends with an `error` event."""
    if args.json:
        print(json.dumps({"event": "error", "model": args.model, "message": message}),
              flush=True)
    print(f"mlxctl: {message}", file=sys.stderr)
    return code


def _failure(what: str, e: BaseException, resumable: bool = False) -> str:
    name = type(e).__name__
    text = str(e).strip().splitlines()[0] if str(e).strip() else name
    hint = "; run the same command again to resume" if resumable else ""
    return f"could not download {what}: {name}: {text}{hint}"


def cmd_pull(args, client, deps) -> int:
    what = f"{args.model}/{args.gguf}" if args.gguf else args.model
    if args.gguf is not None and not args.gguf.lower().endswith(".gguf"):
        print(f"mlxctl: --gguf names a .gguf file of the repo, not {args.gguf!r}",
              file=sys.stderr)
        return EXIT_USAGE
    from huggingface_hub import constants as hf_constants
    from huggingface_hub.utils import logging as hf_logging

    # Its warnings ("Trying to resume download...") would break the redrawn bars; its
    # retries are silent, and a failure is said once, below.
    hf_logging.set_verbosity_error()
    # huggingface_hub reads (and reports) a download in pieces of this size: 1 MiB
    # moves the bars smoothly and loses at most that much to an interruption (its
    # default, 10 MiB, is several seconds of a slow line). Read at each download.
    hf_constants.DOWNLOAD_CHUNK_SIZE = 1 << 20
    hub = deps.hub
    try:
        commit, listed = hub.files(args.model, args.revision)
    except Exception as e:  # network, auth, unknown repo: said plainly
        return _fail(args, _failure(what, e))
    files = wanted(listed, args.gguf)
    if not files:
        return _fail(args, f"{what}: " + ("no such file in the repo" if args.gguf else
                                          "the repo has no files an MLX model is made of"))
    progress = Progress(files, out=sys.stdout if args.json else sys.stderr,
                        tty=not args.json and sys.stderr.isatty(), json_lines=args.json)
    if not args.json:
        print(f"pulling {what} ({human_bytes(progress.total())}, {len(files)} files) "
              f"from Hugging Face", file=sys.stderr)
    progress.begin(args.model)
    path = None
    try:
        for name, _ in files:
            found = hub.cached(args.model, name, commit)
            if found is not None:
                progress.finish(name, cached=True)
            else:
                found = hub.download(args.model, name, args.revision, bar_class(progress, name))
                progress.finish(name)
            # The snapshot folder (`*.json` matches nested files too, as in
            # huggingface_hub), or the one GGUF file.
            path = Path(found) if args.gguf else Path(found).parents[len(Path(name).parts) - 1]
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return _fail(args, f"pull of {what} interrupted; run the same command again "
                     "to resume", EXIT_INTERRUPTED)
    except Exception as e:  # what arrived is kept: the next pull continues it
        return _fail(args, _failure(what, e, resumable=True))
    return _report(args, what, path)


def _report(args, what: str, path: Path) -> int:
    from supervisor.memory import catalog

    if args.gguf:
        # Converted by the worker on its first load (worker/loading/gguf/), once per file.
        body = {"event": "complete", "model": what, "path": str(path), "mlx": False,
                "gguf": True, "size_bytes": path.stat().st_size}
        text = (f"{what}: {path}\nload it with `mlxctl load {path}` or `mlxd --model {path}` "
                "(converted to MLX on its first load)")
    else:
        mlx = catalog.is_mlx_model(path, args.model)
        body = {"event": "complete", "model": args.model, "path": str(path), "mlx": mlx,
                "size_bytes": catalog.weights_bytes(path)}
        text = f"{args.model}: {path}"
        if not mlx:
            text += ("\nwarning: this does not look like an MLX model; look for an MLX "
                     "version (e.g. under mlx-community/), convert it with `mlx_lm.convert`, "
                     "or, for a GGUF repo, pull one file: `mlxctl pull REPO --gguf FILE.gguf`")
    if args.json:
        print(json.dumps(body))
    else:
        print(text)
    return EXIT_OK


def cmd_rm(args, client, deps) -> int:
    from supervisor.memory.hf_delete import NotCached, delete_cached, repo_folder

    try:
        repo_folder(args.model)   # a repo id, or nothing is asked of anyone
    except ValueError as e:
        print(f"mlxctl: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        body = client.call("POST", "/admin/delete", {"model": args.model}, timeout=300)
    except ServerDown:  # nothing runs, so nothing is loaded: delete it here
        try:
            path, freed = delete_cached(args.model)
        except NotCached:
            print(f"mlxctl: {args.model} is not in the Hugging Face cache", file=sys.stderr)
            return EXIT_UNHEALTHY
        body = {"model": args.model, "path": str(path), "freed_bytes": freed}
    emit(args, body, f"removed {body['model']} ({human_bytes(body['freed_bytes'])} freed): "
                     f"{body['path']}")
    return EXIT_OK


def add_parsers(add) -> None:
    sp = add("pull", cmd_pull, "download a model from Hugging Face, with progress")
    sp.add_argument("model")
    sp.add_argument("--revision", default=None)
    sp.add_argument("--gguf", default=None, metavar="FILE",
                    help="download only this .gguf file of the repo (mlxd converts it on load)")
    add("rm", cmd_rm, "delete a model from the Hugging Face cache (refused while loaded)"
        ).add_argument("model")
