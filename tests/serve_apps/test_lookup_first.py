"""A replica serving EAGLE-3 after prompt lookup (`lookup: true`, as a winner of the benchmark's
`eagle3+lookup` variant deploys it): the service builds the hybrid, rows that repeat their
context draft past the head's K, and greedy output over HTTP equals plain decoding. In-process,
without Ray (the Serve endpoint itself is `test_openai_endpoint.py`)."""

from __future__ import annotations

import asyncio

import httpx

from aerie.engine.hybrid import LookupFirstProposer
from aerie.generate import run_generate
from aerie.serving.config import ServeConfig
from aerie.serving.http import create_app
from aerie.serving.service import OpenAIService
from aerie.winner import Winner

REPEATING = "def read(path):\n    return open(path).read()\n\ndef read(path):\n    return open(path).read()\n\n" * 3


def test_a_lookup_first_winner_serves_losslessly_and_drafts_by_lookup(served_target_dir, served_head_dir, tmp_path):
    winner = tmp_path / "winner.json"
    Winner(target=str(served_target_dir), method="eagle3", head=str(served_head_dir), k=3, lookup=True).save(winner)
    service = OpenAIService(ServeConfig(winner=str(winner), max_slots=2, max_len=512))
    try:
        engine = service.loop.engine
        assert isinstance(engine.proposer, LookupFirstProposer)

        async def complete() -> httpx.Response:
            transport = httpx.ASGITransport(app=create_app(service))
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                body = {"model": "tiny-served", "prompt": REPEATING, "max_tokens": 32, "temperature": 0}
                return await client.post("/v1/completions", json=body)

        reply = asyncio.run(complete()).json()
    finally:
        service.close()
    [expected] = run_generate(str(served_target_dir), [REPEATING], max_tokens=32)
    assert reply["choices"][0]["text"] == expected["text"]
    spec = engine.spec
    assert len(spec.accepted_per_position) > 3, "no row drafted past K by lookup"
