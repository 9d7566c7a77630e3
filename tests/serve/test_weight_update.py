"""/update_weights_from_disk (SGLang's): another checkpoint of the same architecture is
compiled as the served artefact was and its weights copied in, on two ranks:
answers become the new checkpoint's, a request in flight finishes on the old weights, one
that compiles to another program (or is not there) is a 400 and changes nothing, only the
admin key may ask, and a request paused in flight is computed again on the new weights."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from serve_helpers import ADMIN_KEY, API_KEY, wait_until_running

from kiln import Engine

PROMPT = [1, 5, 9, 14, 3]
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def answers(artefact) -> dict[str, list[int]]:
    """Each checkpoint's greedy ids for PROMPT (one-rank engines): the served one, and the
    same architecture from another seed."""
    out = {}
    for name, kw in (("old", {}), ("new", {"seed": 1})):
        engine = Engine(artefact("llama", **kw), max_total_tokens=512)
        out[name] = engine.generate(input_ids=[PROMPT], sampling_params=GREEDY)[0]["output_ids"]
        engine.shutdown()
    assert out["old"] != out["new"]
    return out


def _ids(server, max_new_tokens: int = 12) -> list[int]:
    params = {**GREEDY, "max_new_tokens": max_new_tokens}
    r = server.post("/generate", json={"input_ids": PROMPT, "sampling_params": params})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_new_weights_are_served(artefact, checkpoint, answers, launch) -> None:
    """On a two-rank artefact (rank 0 and the other rank's process both checked, then both
    copied): the tests' shared tp=2 compile."""
    server = launch(
        artefact("llama", compile_args={"tp_size": 2}),
        "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY, "--max-total-tokens", "1024",
    )  # fmt: skip
    assert _ids(server) == answers["old"]
    new = str(checkpoint("llama", seed=1))
    r = server.post("/update_weights_from_disk", json={"model_path": new})
    assert r.status_code == 401, r.text  # the shared key cannot change everyone's model
    body = {"model_path": new, "weight_version": "seed-1"}
    r = server.post("/update_weights_from_disk", key=ADMIN_KEY, json=body)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert _ids(server) == answers["new"]
    assert server.get("/get_weight_version").json()["weight_version"] == "seed-1"
    for path, message in (
        (str(checkpoint("llama", num_layers=3)), "compiles to another program"),
        ("/nonexistent/checkpoint", "model_path: "),
    ):
        r = server.post("/update_weights_from_disk", key=ADMIN_KEY, json={"model_path": path})
        assert r.status_code == 400 and message in r.json()["message"], r.text
    assert _ids(server) == answers["new"]  # nothing changed
    # a trainer's round: generation paused with a request in flight, the weights changed
    # under it (num_paused_requests), then continued: it ends, on the new weights
    old = str(checkpoint("llama"))

    async def run() -> tuple[list[int], httpx.Response]:
        auth = {"Authorization": f"Bearer {API_KEY}"}
        admin = {"headers": {"Authorization": f"Bearer {ADMIN_KEY}"}}
        async with httpx.AsyncClient(base_url=server.url, headers=auth, timeout=120) as c:
            params = {**GREEDY, "max_new_tokens": 200}
            running = asyncio.ensure_future(
                c.post("/generate", json={"input_ids": PROMPT, "sampling_params": params})
            )
            await wait_until_running(c, 1)
            paused = await c.post("/pause_generation", json={"mode": "in_place"}, **admin)
            assert paused.is_success, paused.text
            update = await c.post("/update_weights_from_disk", json={"model_path": old}, **admin)
            assert (await c.post("/continue_generation", json={}, **admin)).is_success
            return (await running).json()["output_ids"], update

    ids, update = asyncio.run(run())
    assert update.status_code == 200 and update.json()["num_paused_requests"] == 1, update.text
    assert len(ids) == 200
    assert _ids(server) == answers["old"]


def test_an_artefact_with_a_draft_is_not_updated() -> None:
    """A draft model or an EAGLE head (a model's own MTP layer included: no draft path) lives
    in draft/, which an update does not reload: a 400 saying so, before any compile."""
    from kiln.serve.streams import ApiError
    from kiln.serve.weight_update import update_args

    draft = {"cache_key": "0" * 64, "vocab_size": 10}
    for algorithm in ("STANDALONE", "EAGLE"):
        manifest = {
            "compile_args": {"model_path": "m", "speculative_algorithm": algorithm},
            "runtime": {"speculative": {"algorithm": algorithm, "draft": draft}},
            "target": {"isa": "x86-64"},
        }
        with pytest.raises(ApiError, match="draft model or an EAGLE head") as e:
            update_args(manifest, "new", None)
        assert e.value.status == 400
