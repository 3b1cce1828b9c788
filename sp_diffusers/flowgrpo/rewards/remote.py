"""Rewards over HTTP: ``sp-diffusers reward-server`` serves any reward function, and a ``flowgrpo.rewards`` entry
``{url: http://host:port}`` scores through it, so a reward model can live on its own GPU or machine.

The wire format is JSON. ``POST /score`` takes ``{"input": T, "prompts": [...], "metadata": [...], "kwargs": {...}}``
and answers ``{"rewards": [one float per sample]}``. ``T`` (and a tensor inside a metadata row) is
``{"dtype": "float32", "shape": [...], "data": base64 of its bytes, little-endian}``. A payload the server cannot
use is answered 400 with one line naming the field; a reward function that raises, 500 with its error.
``GET /health`` names the served function. The client retries a failed or timed-out request (not a 400).
"""

from __future__ import annotations

import asyncio
import base64
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["RemoteReward", "RewardServerError", "decode_tensor", "encode_tensor", "make_app", "serve"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "uint8": torch.uint8}
_NAMES = {v: k for k, v in _DTYPES.items()}


class RewardServerError(RuntimeError):
    """A reward server failed, or answered what no reward server answers; the message names it and the fix."""


class PayloadError(ValueError):
    """A request the server refuses (400); the message names the field."""


def encode_tensor(t: torch.Tensor) -> dict[str, Any]:
    t = t.detach().cpu().contiguous()
    if t.dtype not in _NAMES:
        t = t.float()
    raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data": base64.b64encode(raw).decode("ascii")}


def decode_tensor(obj: Any, field: str) -> torch.Tensor:
    if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "data"}:
        raise PayloadError(f"{field} must be {{dtype, shape, data}}, got {str(obj)[:80]}")
    dtype, shape = _DTYPES.get(obj["dtype"]), obj["shape"]
    if dtype is None:
        raise PayloadError(f"{field}.dtype={obj['dtype']!r}: one of {', '.join(_DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise PayloadError(f"{field}.shape={shape!r}: a list of sizes >= 0")
    try:
        raw = base64.b64decode(obj["data"], validate=True)
    except (ValueError, TypeError) as err:
        raise PayloadError(f"{field}.data is not base64: {err}") from None
    numel = math.prod(shape)
    expected = numel * torch.empty((), dtype=dtype).element_size()
    if len(raw) != expected:
        raise PayloadError(f"{field}: {len(raw)} bytes of data for shape {shape} in {obj['dtype']} ({expected})")
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def _metadata(rows: Any, count: int) -> list[dict]:
    if not isinstance(rows, list) or len(rows) != count or not all(isinstance(r, dict) for r in rows):
        raise PayloadError(f"metadata must be a list of {count} objects (one per sample)")
    out = []
    for i, row in enumerate(rows):
        out.append(
            {
                k: decode_tensor(v, f"metadata[{i}].{k}") if isinstance(v, dict) and "dtype" in v else v
                for k, v in row.items()
            }
        )
    return out


def score_request(fn: Callable[..., Any], body: Any, max_batch: int) -> list[float]:
    """Check a request's body, call ``fn`` and return one finite float per sample (``PayloadError``: a 400)."""
    if not isinstance(body, dict):
        raise PayloadError("the body must be a JSON object {input, prompts, metadata, kwargs}")
    unknown = sorted(set(body) - {"input", "prompts", "metadata", "kwargs"})
    if unknown or "input" not in body or "prompts" not in body:
        raise PayloadError(f"the body needs input and prompts (metadata, kwargs optional); unknown: {unknown}")
    x = decode_tensor(body["input"], "input")
    prompts = body["prompts"]
    if x.dim() < 1 or not isinstance(prompts, list) or len(prompts) != x.shape[0]:
        raise PayloadError(f"prompts must be a list of {x.shape[0] if x.dim() else '?'} strings (input's batch)")
    if not all(isinstance(p, str) for p in prompts):
        raise PayloadError("prompts must be strings")
    if len(prompts) > max_batch:
        raise PayloadError(f"{len(prompts)} samples in one request; this server takes at most {max_batch}")
    metadata = _metadata(body.get("metadata", [{}] * len(prompts)), len(prompts))
    kwargs = body.get("kwargs", {})
    if not isinstance(kwargs, dict):
        raise PayloadError("kwargs must be an object of keyword arguments")
    out = fn(x.float() if x.dtype != torch.uint8 else x, prompts, metadata, **kwargs)
    scores = torch.as_tensor(out, dtype=torch.float64).flatten().tolist()
    if len(scores) != len(prompts) or not all(math.isfinite(s) for s in scores):
        raise RuntimeError(f"the reward function returned {len(scores)} scores for {len(prompts)} samples, or a NaN")
    return scores


def make_app(fn: Callable[..., Any], ref: str, max_batch: int = 256) -> Any:
    """The aiohttp application serving ``fn`` (``ref`` names it on ``/health``); one request scored at a time."""
    from aiohttp import web

    lock = asyncio.Lock()

    async def score(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "the body is not JSON"}, status=400)
        async with lock:  # the reward model is one: requests queue here
            try:
                scores = await asyncio.to_thread(score_request, fn, body, max_batch)
            except PayloadError as err:
                return web.json_response({"error": str(err)}, status=400)
            except Exception as err:
                return web.json_response({"error": f"{ref} raised {type(err).__name__}: {err}"}, status=500)
        return web.json_response({"rewards": scores})

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"reward": ref, "ok": True})

    app = web.Application(client_max_size=1 << 30)
    app.add_routes([web.post("/score", score), web.get("/health", health)])
    return app


def serve(fn: Callable[..., Any], ref: str, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 256) -> None:
    """``sp-diffusers reward-server``: serve ``fn`` (loaded from ``ref``) until interrupted."""
    from aiohttp import web

    print(f"serving {ref} on http://{host}:{port} (POST /score, GET /health)", flush=True)
    web.run_app(make_app(fn, ref, max_batch), host=host, port=port, print=None)


class RemoteReward:
    """A reward scored by a reward server: ``(x, prompts, metadata, **kwargs) -> [B]`` like a local one."""

    def __init__(self, url: str, timeout: float = 60.0, retries: int = 2) -> None:
        self.url, self.timeout, self.retries = url.rstrip("/"), timeout, retries
        self.__name__ = url
        # one client per calling thread (the main one, the background scoring's): its connection is kept open
        # between calls, where httpx.post builds a client (an SSL context: ~40 ms of CPU) per request
        self._clients = threading.local()

    def _client(self) -> Any:
        import httpx

        client = getattr(self._clients, "client", None)
        if client is None:
            client = self._clients.client = httpx.Client(timeout=self.timeout)
        return client

    def __call__(self, x: torch.Tensor, prompts: list[str], metadata: list[dict], **kwargs: Any) -> list[float]:
        import httpx

        body = {
            "input": encode_tensor(x),
            "prompts": list(prompts),
            "metadata": [
                {k: encode_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in row.items() if _plain(v)}
                for row in metadata
            ],
            "kwargs": kwargs,
        }
        problem = ""
        for attempt in range(self.retries + 1):
            try:
                response = self._client().post(f"{self.url}/score", json=body)
            except httpx.HTTPError as err:
                problem = f"{type(err).__name__}: {err}"
            else:
                if response.status_code == 200:
                    rewards = _rewards_of(response, len(prompts))
                    if isinstance(rewards, list):
                        return rewards
                    raise RewardServerError(
                        f"reward server {self.url} answered {rewards}; fix: point the entry's url at "
                        "`sp-diffusers reward-server` (or a server that answers {\"rewards\": [one float per sample]})"
                    )
                problem = f"HTTP {response.status_code}: {_error_of(response)[:500]}"
                if response.status_code < 500:
                    break  # the request itself is wrong: another try gives the same answer
            if attempt < self.retries:
                time.sleep(min(2.0**attempt, 10.0))
        raise RewardServerError(
            f"reward server {self.url}: {problem} (after {attempt + 1} tries); fix: start it with "
            "`sp-diffusers reward-server --reward pkg.module:callable --port N`, or raise the entry's timeout"
        )


def _rewards_of(response: Any, count: int) -> list[float] | str:
    """The answer's scores, or what is wrong with the answer (a proxy's page, another service, a broken server)."""
    try:
        body = response.json()
    except ValueError:
        return f"HTTP 200 with a body that is not JSON ({response.text[:80]!r})"
    rewards = body.get("rewards") if isinstance(body, dict) else None
    if not isinstance(rewards, list) or len(rewards) != count:
        return f"HTTP 200 without {{\"rewards\": [{count} numbers]}} ({str(body)[:80]!r})"
    if not all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in rewards):
        return f"HTTP 200 with rewards that are not all numbers ({str(rewards)[:80]!r})"
    return [float(r) for r in rewards]


def _error_of(response: Any) -> str:
    try:
        return str(response.json().get("error", response.text))
    except ValueError:  # not our server's JSON (a proxy's page)
        return response.text


def _plain(value: Any) -> bool:
    """What travels in a metadata row: tensors, and values JSON takes (others, e.g. PIL images, are left out)."""
    return isinstance(value, (torch.Tensor, str, int, float, bool, type(None), list, dict))
