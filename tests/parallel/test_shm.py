"""The shared-memory channel of same-machine ranks: commands larger than its area go in chunks, collectives sum in
rank order, and a rank that does not come is named after the timeout."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from litellm_pipeline.parallel import shm
from litellm_pipeline.parallel.shm import CMD_BYTES, SharedRegion

pytestmark = pytest.mark.skipif(not shm.usable(), reason="x86 with /dev/shm")


@pytest.fixture
def pair():
    driver = SharedRegion.create(2)
    worker = SharedRegion(driver.path, 2, 1)
    yield driver, worker
    driver.remove()


def test_a_command_larger_than_the_area_arrives_whole(pair):
    driver, worker = pair
    payloads = [os.urandom(2 * CMD_BYTES + 12345), b"small", os.urandom(CMD_BYTES)]
    got = []
    t = threading.Thread(target=lambda: got.extend(worker.receive() for _ in payloads))
    t.start()
    for p in payloads:
        driver.send(p, timeout_s=30)
    t.join(30)
    assert got == payloads
    assert driver.acks(1) == driver.commands == 5  # 3 + 1 + 1 chunks


def test_all_reduce_and_all_gather_agree_on_every_rank(pair):
    driver, worker = pair
    a, b = torch.randn(7, 33), torch.randn(7, 33)
    out = {}
    t = threading.Thread(target=lambda: out.update(w=worker.all_reduce(b, 30), wg=worker.all_gather(b[:, :5], 30)))
    t.start()
    out["d"], out["dg"] = driver.all_reduce(a, 30), driver.all_gather(a[:, :5].contiguous(), 30)
    t.join(30)
    assert torch.equal(out["d"], a + b) and torch.equal(out["w"], a + b)
    assert all(torch.equal(x, y) for x, y in zip(out["dg"], [a[:, :5], b[:, :5]]))
    assert all(torch.equal(x, y) for x, y in zip(out["wg"], out["dg"]))


def test_a_rank_that_does_not_come_is_named(pair):
    driver, _ = pair
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] did not reach collective 1 within 0.3 s"):
        driver.all_reduce(torch.ones(3), 0.3)
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] did not take command chunk 1"):
        driver.send(b"x", 0.3)
