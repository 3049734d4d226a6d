"""simulator/cp_cost.py against hand-computed values (see each test)."""
from __future__ import annotations

import pytest

from autopar.simulator.axes.cp import (activation_bytes_per_rank, causal_pairs, cp_attention_cost, kv_bytes,
                                       load_imbalance)


def test_causal_pairs_by_hand():
    # seq 8, cp 2, head-tail: chunks of 2; rank 0 holds positions 0,1,6,7 -> 1+2+7+8 = 18 pairs,
    # rank 1 holds 2,3,4,5 -> 3+4+5+6 = 18; the whole causal square has 8*9/2 = 36
    assert causal_pairs(8, 2, 0) == 18 and causal_pairs(8, 2, 1) == 18
    # contiguous: rank 0 holds 0..3 -> 1+2+3+4 = 10, rank 1 holds 4..7 -> 5+6+7+8 = 26
    assert causal_pairs(8, 2, 0, "contiguous") == 10 and causal_pairs(8, 2, 1, "contiguous") == 26
    assert load_imbalance(8, 2) == 1.0
    assert load_imbalance(8, 2, "contiguous") == pytest.approx(26 / 18)


def test_contiguous_imbalance_tends_to_2cp_minus_1_over_cp():
    # the last rank's queries see (cp - 1/2) chunks on average against the mean cp/2
    for cp in (2, 4, 8):
        assert load_imbalance(2 ** 16, cp, "contiguous") == pytest.approx((2 * cp - 1) / cp, rel=1e-3)
        assert load_imbalance(2 ** 16, cp) == 1.0


def test_all_gather_exchange_by_hand():
    # B 1, S 1024, 8 KV heads of 128, bf16: K+V = 2*1*1024*8*128*2 = 4 MiB; cp 4 sends 3/4 of it
    full = kv_bytes(1, 1024, 8, 128, 2)
    assert full == 4 * 2 ** 20
    c = cp_attention_cost(micro_batch=1, seq=1024, kv_heads=8, head_dim=128, elem_bytes=2, cp=4,
                          attention_fwd_s=1.0, attention_bwd_s=2.0, bandwidth_Bps=1e9, latency_s=1e-5)
    wire = 3 * 2 ** 20
    assert c.exchange_fwd_s == pytest.approx(wire / 1e9 + 3e-5)     # exposed, whatever the compute
    assert c.exchange_bwd_s == pytest.approx(wire / 1e9 + 3e-5)
    assert c.wire_bytes == 2 * wire and c.kv_buffer_bytes == wire


def test_ring_hides_behind_compute_or_shows_the_excess():
    kw = dict(micro_batch=1, seq=1024, kv_heads=8, head_dim=128, elem_bytes=2, cp=4, bandwidth_Bps=1e9, latency_s=0.0)
    block = 2 ** 20                                                   # 4 MiB / 4
    # compute long enough: 1 s / 4 per step >> 1 MiB / 1 GB/s
    c = cp_attention_cost(attention_fwd_s=1.0, attention_bwd_s=2.0, method="ring", **kw)
    assert c.exchange_fwd_s == 0.0 and c.exchange_bwd_s == 0.0
    # no compute: every step's transfer shows, 3 steps; backward passes twice the bytes
    c = cp_attention_cost(attention_fwd_s=0.0, attention_bwd_s=0.0, method="ring", **kw)
    assert c.exchange_fwd_s == pytest.approx(3 * block / 1e9)
    assert c.exchange_bwd_s == pytest.approx(3 * 2 * block / 1e9)
    assert c.kv_buffer_bytes == 2 * block


def test_cp_one_costs_nothing_and_activations_divide():
    c = cp_attention_cost(micro_batch=1, seq=16, kv_heads=1, head_dim=4, elem_bytes=4, cp=1,
                          attention_fwd_s=1.0, attention_bwd_s=1.0, bandwidth_Bps=1.0, latency_s=1.0)
    assert (c.exchange_fwd_s, c.exchange_bwd_s, c.wire_bytes) == (0.0, 0.0, 0.0)
    assert activation_bytes_per_rank(1024.0, 8) == 128.0
