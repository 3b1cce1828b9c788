"""The reward server and the url reward entry: a real aiohttp server on a free local port, a real HTTP client."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from sp_diffusers.flowgrpo.config import ConfigError
from sp_diffusers.flowgrpo.rewards.loading import reward_specs
from sp_diffusers.flowgrpo.rewards.remote import RemoteReward, encode_tensor, make_app

ROOT = Path(__file__).resolve().parents[1]
CALLS: list[int] = []


def brightness(images: torch.Tensor, prompts: list[str], metadata: list[dict], scale: float = 1.0) -> torch.Tensor:
    """A reward of the documented form: one float per sample."""
    CALLS.append(len(prompts))
    bonus = torch.tensor([float(m.get("bonus", 0.0)) for m in metadata])
    return images.mean(dim=(1, 2, 3)) * scale + bonus


def slow(images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> list[float]:
    time.sleep(1.5)
    return [0.0] * len(prompts)


def broken(images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> list[float]:
    raise ValueError("the reward model is not loaded")


GARBAGE = {
    "html": "<html>502 Bad Gateway</html>",
    "short": '{"rewards": [1.0]}',
    "words": '{"rewards": ["high", "low"]}',
    "other": '{"score": [1.0, 2.0]}',
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    """One aiohttp server per function, in a thread of their own event loop."""
    from aiohttp import web

    loop = asyncio.new_event_loop()
    urls, runners = {}, []

    async def start() -> None:
        for name, fn in (("brightness", brightness), ("slow", slow), ("broken", broken)):
            runner = web.AppRunner(make_app(fn, f"tests:{name}", max_batch=8))
            await runner.setup()
            port = _free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            urls[name] = f"http://127.0.0.1:{port}"
            runners.append(runner)

        for name, text in GARBAGE.items():  # servers that answer 200 with what no reward server answers

            async def answer(_request: web.Request, text: str = text) -> web.Response:
                return web.Response(text=text)

            app = web.Application()
            app.add_routes([web.post("/score", answer)])
            runner = web.AppRunner(app)
            await runner.setup()
            port = _free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            urls[name] = f"http://127.0.0.1:{port}"
            runners.append(runner)

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=30)
    yield urls
    for runner in runners:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=30)
    loop.call_soon_threadsafe(loop.stop)


def test_a_url_entry_scores_what_the_function_gives_locally(servers):
    images = torch.rand(3, 3, 8, 8)
    prompts = ["a", "b", "c"]
    metadata = [{"bonus": 1.0}, {}, {"bonus": 2.0, "source_image": torch.rand(3, 8, 8)}]
    (spec,) = reward_specs([{"url": servers["brightness"], "kwargs": {"scale": 2.0}, "name": "bright"}], "color")
    assert spec.input == "pixels" and spec.name == "bright"
    got = spec.fn(images, prompts, metadata, **spec.kwargs)
    want = brightness(images, prompts, metadata, scale=2.0).tolist()
    assert got == pytest.approx(want, abs=1e-6)  # float32 on both sides; JSON carries float64


def test_bad_payloads_are_refused_with_the_field_named(servers):
    url = servers["brightness"] + "/score"
    x = encode_tensor(torch.rand(2, 3, 4, 4))
    cases = {
        "not an object": ([1, 2], "JSON object"),
        "no prompts": ({"input": x}, "needs input and prompts"),
        "prompts of another batch": ({"input": x, "prompts": ["a"]}, "prompts must be a list of 2"),
        "short data": ({"input": {**x, "data": x["data"][:8]}, "prompts": ["a", "b"]}, "bytes of data"),
        "unknown dtype": ({"input": {**x, "dtype": "int64"}, "prompts": ["a", "b"]}, "input.dtype"),
        "too many": (
            {"input": encode_tensor(torch.rand(9, 3, 2, 2)), "prompts": ["p"] * 9},
            "at most 8",
        ),
        "metadata rows": ({"input": x, "prompts": ["a", "b"], "metadata": [{}]}, "metadata must be a list of 2"),
    }
    for what, (body, message) in cases.items():
        response = httpx.post(url, json=body, timeout=30)
        assert response.status_code == 400, what
        assert message in response.json()["error"], (what, response.json())
    response = httpx.post(url, content=b"{not json", timeout=30)
    assert response.status_code == 400 and "not JSON" in response.json()["error"]


def test_failures_are_one_line_that_names_the_server_and_4xx_is_not_retried(servers):
    images, prompts, metadata = torch.rand(2, 3, 4, 4), ["a", "b"], [{}, {}]
    with pytest.raises(RuntimeError, match=r"HTTP 500: tests:broken raised ValueError: the reward model is not loaded"):
        RemoteReward(servers["broken"], timeout=30, retries=0)(images, prompts, metadata)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"ReadTimeout.*after 2 tries.*raise the entry's timeout"):
        RemoteReward(servers["slow"], timeout=0.3, retries=1)(images, prompts, metadata)
    assert time.monotonic() - start < 10
    CALLS.clear()
    with pytest.raises(RuntimeError, match=r"HTTP 400: .*at most 8 .*after 1 tries"):
        RemoteReward(servers["brightness"], timeout=30, retries=3)(torch.rand(9, 3, 2, 2), ["p"] * 9, [{}] * 9)
    assert CALLS == []
    dead = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(RuntimeError, match=r"ConnectError.*sp-diffusers reward-server --reward"):
        RemoteReward(dead, timeout=5, retries=0)(images, prompts, metadata)


def test_a_server_that_answers_garbage_is_one_line_naming_what_came_back(servers):
    images, prompts, metadata = torch.rand(2, 3, 4, 4), ["a", "b"], [{}, {}]
    said = {
        "html": r"a body that is not JSON \('<html>502 Bad Gateway",
        "short": r"without \{\"rewards\": \[2 numbers\]\}",
        "words": r"rewards that are not all numbers \(\"\['high', 'low'\]",
        "other": r"without .*'score'",
    }
    for name, words in said.items():
        with pytest.raises(RuntimeError, match=rf"reward server {servers[name]} answered HTTP 200 .*{words}.*fix: "):
            RemoteReward(servers[name], timeout=30, retries=2)(images, prompts, metadata)


def test_url_entries_are_checked_at_start():
    cases = {
        "both": ({"fn": "color", "url": "http://h:1"}, "needs one of fn"),
        "scheme": ({"url": "h:1"}, r"url='h:1' must be http://host:port"),
        "timeout": ({"url": "http://h:1", "timeout": 0}, r"timeout=0 must be seconds > 0"),
        "retries": ({"url": "http://h:1", "retries": -1}, r"retries=-1 must be an int >= 0"),
        "fn with timeout": ({"fn": "color", "timeout": 3}, r"\['timeout'\] apply to a url entry"),
    }
    for entry, message in cases.values():
        with pytest.raises(ConfigError, match=message):
            reward_specs([entry], "color")


def test_the_cli_serves_a_file_s_function(tmp_path):
    reward = tmp_path / "my_reward.py"
    reward.write_text(
        "def score(images, prompts, metadata):\n    return [float(len(p)) for p in prompts]\n"
    )
    port = _free_port()
    cmd = [sys.executable, "-m", "sp_diffusers.cli", "reward-server", "--reward", f"{reward}:score"]
    proc = subprocess.Popen([*cmd, "--port", str(port)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                health = httpx.get(f"{url}/health", timeout=1).json()
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            raise AssertionError("the server did not start")
        assert health == {"reward": f"{reward}:score", "ok": True}
        assert RemoteReward(url)(torch.rand(2, 3, 2, 2), ["ab", "abcd"], [{}, {}]) == [2.0, 4.0]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_url_reward_is_scored_over_the_sp_group(servers):
    from ._dist import run_distributed

    CALLS.clear()
    results = run_distributed("tests.workers.reward_checks:remote_scoring", 2, servers["brightness"])
    for r in results:
        torch.testing.assert_close(r["total"], results[0]["single"])  # every rank has every sample's score
    assert sorted(CALLS) == [2, 3]  # 5 samples over 2 SP ranks, one request each
