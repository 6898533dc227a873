"""RecurrentStatePool: requests admitted at different times step together, each equal to its own
one-pass output, in states of fixed size written in place."""

from __future__ import annotations

import pytest
import torch

import mha
from mha.models.gated_deltanet import GatedDeltaNet


def layer(seed: int = 0) -> GatedDeltaNet:
    torch.manual_seed(seed)
    net = GatedDeltaNet(16, 2, 4, 8, 6, conv_kernel=4).double()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return net


def test_requests_admitted_at_different_times_decode_together():
    net, g = layer(), torch.Generator().manual_seed(1)
    a = torch.randn(1, 14, 16, generator=g, dtype=torch.float64)  # request a: 5 + 9 tokens
    b = torch.randn(1, 10, 16, generator=g, dtype=torch.float64)  # request b: 4 + 6 tokens
    with torch.no_grad():
        want_a, want_b = net(a), net(b)
        pool = mha.RecurrentStatePool(3)
        sa = pool.add_sequence()
        got_a = [pool.step(net, a[:, :5], [sa])]
        got_a += [pool.step(net, a[:, t : t + 1], [sa]) for t in range(5, 8)]  # a decodes alone
        conv, memory = pool.conv, pool.memory
        assert conv is not None and memory is not None
        ptrs, size = (conv.data_ptr(), memory.data_ptr()), pool.nbytes
        sb = pool.add_sequence()
        got_b = [pool.step(net, b[:, :4], [sb])]
        for t in range(6):  # then both, one batch of two rows
            out = pool.step(net, torch.cat([a[:, 8 + t : 9 + t], b[:, 4 + t : 5 + t]]), [sa, sb])
            got_a.append(out[:1])
            got_b.append(out[1:])
    torch.testing.assert_close(torch.cat(got_a, 1), want_a)
    torch.testing.assert_close(torch.cat(got_b, 1), want_b)
    assert (pool.conv.data_ptr(), pool.memory.data_ptr()) == ptrs  # written in place
    assert pool.nbytes == 2 * size  # two requests, each the same fixed size
    assert (pool.tokens(sa), pool.tokens(sb)) == (14, 10)


def test_a_freed_slot_starts_the_next_request_from_nothing():
    net, g = layer(), torch.Generator().manual_seed(2)
    x = torch.randn(1, 6, 16, generator=g, dtype=torch.float64)
    y = torch.randn(1, 5, 16, generator=g, dtype=torch.float64)
    with torch.no_grad():
        pool = mha.RecurrentStatePool(1)
        s = pool.add_sequence()
        pool.step(net, x, [s])
        with pytest.raises(ValueError, match="all 1 slots are in use"):
            pool.add_sequence()
        pool.free_sequence(s)
        s2 = pool.add_sequence()
        assert s2 == s
        torch.testing.assert_close(pool.step(net, y, [s2]), net(y))


def test_bad_use_gets_a_clear_error():
    net = layer()
    pool = mha.RecurrentStatePool(2)
    s = pool.add_sequence()
    x = torch.randn(2, 1, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="num_slots"):
        mha.RecurrentStatePool(0)
    with pytest.raises(TypeError, match="GatedDeltaNet"):
        pool.step(torch.nn.Linear(16, 16), x[:1], [s])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="admitted slot"):
        pool.step(net, x[:1], [1])
    with pytest.raises(ValueError, match="one distinct admitted slot per row"):
        pool.step(net, x, [s])
    with torch.no_grad():
        pool.step(net, x[:1], [s])
    other = GatedDeltaNet(16, 2, 2, 8, 6).double()
    with pytest.raises(ValueError, match="one pool per layer"):
        pool.step(other, x[:1], [s])
    with pytest.raises(ValueError, match="admitted slot"):
        pool.free_sequence(5)
