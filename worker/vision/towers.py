"""The vision tower of a burst's image prompts, run once for all of them.

A burst of image chats prefilled as one batch (worker/vision/group.py) still embedded its
images prompt by prompt, each a call of the vision tower of its own: on a GPU, a tower's
pass for one image leaves most of the device idle, and each is a launch sequence of its
own. mlx-vlm's own `batch_generate` runs a group's images (of one shape) through the
tower in one call; here the same, handed to each prompt's embedding by the
`cached_image_features` argument that mlx-vlm's families take for precomputed features
(mlx-vlm's own vision cache uses it). Each prompt's share of the features is as many as
its image tokens, in order: the towers return the images' features one after another.

How each family's tower is called differs (its embedding step does it inline), so only
the families below, each tested against its prompts alone (tests/worker/
test_worker_vision_group.py), are batched; any other runs its tower per prompt, as
before. Within a
family, the prompts batched together are those whose images can be stacked: all for
Qwen's towers (patch rows, each image's grid beside them), those whose images share one
shape for Gemma 4's.
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx


def _qwen2(vlm, pixels, kwargs):
    dtype = vlm.vision_tower.patch_embed.proj.weight.dtype
    return vlm.vision_tower(pixels.astype(dtype), kwargs["image_grid_thw"],
                            output_hidden_states=False)


def _qwen3_5(vlm, pixels, kwargs):
    dtype = vlm.vision_tower.patch_embed.proj.weight.dtype
    return vlm.vision_tower(pixels.astype(dtype), kwargs["image_grid_thw"])[0]


def _gemma4(vlm, pixels, kwargs):
    return vlm.encode_image(pixels, kwargs.get("image_position_ids"))


# model_type -> (the tower's call on stacked images, the token axis of what it returns,
# the config's image token field, the keyword arguments stacked beside the pixels)
FAMILIES: dict[str, tuple[Callable, int, str, tuple[str, ...]]] = {
    "qwen2_vl": (_qwen2, 0, "image_token_id", ("image_grid_thw",)),
    "qwen3_5": (_qwen3_5, 0, "image_token_index", ("image_grid_thw",)),
    "gemma4": (_gemma4, 1, "image_token_id", ("image_position_ids",)),
}
_VIDEO = ("pixel_values_videos", "video_grid_thw", "video_position_ids")


def encode(vlm, jobs: list) -> list[Optional[mx.array]]:
    """Each job's image features (`cached_image_features` for its embedding), from one
    call of the tower for those that can go together; None for a job left to embed its
    own (a family not here, a video, images of another shape, or no company)."""
    out: list[Optional[mx.array]] = [None] * len(jobs)
    family = FAMILIES.get(getattr(vlm.config, "model_type", None))
    if family is None:
        return out
    call, axis, token_field, stacked = family
    groups: dict[tuple, list[int]] = {}
    for i, job in enumerate(jobs):
        if not isinstance(job.pixels, mx.array) or any(k in job.kwargs for k in _VIDEO):
            continue
        present = tuple(k for k in stacked if k in job.kwargs)
        if axis == 0 and present != stacked:  # (Qwen's towers need each image's grid)
            continue
        # Stacked along their first axis: the rest of each shape must agree (Qwen's patch
        # rows always do; Gemma 4's images must be of one size).
        shape = (present, job.pixels.shape[1:],
                 *(job.kwargs[k].shape[1:] for k in present))
        groups.setdefault(shape, []).append(i)
    token = getattr(vlm.config, token_field)
    for members in groups.values():
        if len(members) < 2:
            continue
        group = [jobs[i] for i in members]
        kwargs = {k: mx.concatenate([job.kwargs[k] for job in group])
                  for k in stacked if k in group[0].kwargs}
        features = call(vlm, mx.concatenate([job.pixels for job in group]), kwargs)
        counts = [int((job.inputs == token).sum().item()) for job in group]
        if sum(counts) != features.shape[axis]:  # (not one feature per image token:
            continue                             # each embeds its own, as before)
        starts = [sum(counts[:k]) for k in range(len(counts))]
        for i, start, n in zip(members, starts, counts):
            out[i] = features[start:start + n] if axis == 0 else features[:, start:start + n]
    return out
