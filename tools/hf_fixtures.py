"""Build the small fixtures that test the course's code against Hugging Face's own code.

Run it in a throwaway environment that has ``transformers`` (the course's environment does not)::

    /tmp/hfenv/bin/python tools/hf_fixtures.py              # every family
    /tmp/hfenv/bin/python tools/hf_fixtures.py gated_delta  # some of them

``FAMILIES`` maps a name to the function that writes its fixtures; each family's functions sit in
a block of their own below. The tests read the ``.npz`` files with numpy and torch only.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import transformers

FAMILIES: dict[str, Callable[[], None]] = {}


# --- gated_delta: Qwen3-Next's gated delta rule (section 10.5, mha.gated_delta_rule) -----------
# (a block of its own: at a merge it goes after the FAMILIES dict, before main)
#
# HF's torch reference takes (B, L, H, D) tensors, L2-normalises q and k itself when
# use_qk_l2norm_in_kernel=True, scales q by 1/sqrt(Dk), and returns (out (B, L, H, Dv), state
# (B, H, Dk, Dv)). The fixtures store exactly what HF was called with (q and k *before* the
# l2norm) and what it returned; tests/test_gated_delta.py moves the layout to (B, H, L, D) and
# normalises q and k before calling mha.gated_delta_rule, which expects them normalised.

GATED_DELTA_ROOT = Path(__file__).resolve().parent.parent  # the repository
GATED_DELTA_DIR = GATED_DELTA_ROOT / "tests" / "fixtures" / "hf"


def _gated_delta_inputs(
    seed: int, B: int, L: int, H: int, Dk: int, Dv: int, Hk: int | None = None
) -> dict:
    """Random q, k (B, L, Hk, Dk), v (B, L, H, Dv), log-decays g <= 0, betas in (0, 1), a state
    (B, H, Dk, Dv). Hk < H: each q/k head serves H // Hk value heads (Qwen3-Next: 16 and 32)."""
    gen = torch.Generator().manual_seed(seed)
    Hk = H if Hk is None else Hk
    return {
        "query": torch.randn(B, L, Hk, Dk, generator=gen),
        "key": torch.randn(B, L, Hk, Dk, generator=gen),
        "value": torch.randn(B, L, H, Dv, generator=gen),
        # like the model: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)
        "g": -torch.exp(torch.randn(H, generator=gen) * 0.5)
        * torch.nn.functional.softplus(torch.randn(B, L, H, generator=gen)),
        "beta": torch.sigmoid(torch.randn(B, L, H, generator=gen)),
        "initial_state": torch.randn(B, H, Dk, Dv, generator=gen) * 0.5,
    }


def make_gated_delta() -> None:
    """Both of HF's forms, with and without an initial state, a length that no chunk divides."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    cases = {  # name: (function, chunk_size, L, initial state?, q/k heads)
        "chunk16_state": (hf.torch_chunk_gated_delta_rule, 16, 37, True, 2),
        "chunk64": (hf.torch_chunk_gated_delta_rule, 64, 100, False, 2),
        "recurrent_state": (hf.torch_recurrent_gated_delta_rule, None, 37, True, 2),
        "recurrent": (hf.torch_recurrent_gated_delta_rule, None, 20, False, 2),
        "chunk8_shared_keys": (hf.torch_chunk_gated_delta_rule, 8, 19, True, 1),
    }
    GATED_DELTA_DIR.mkdir(parents=True, exist_ok=True)
    for seed, (case, (fn, chunk_size, L, with_state, Hk)) in enumerate(cases.items()):
        x = _gated_delta_inputs(seed, B=2, L=L, H=2, Dk=8, Dv=6, Hk=Hk)
        state = x["initial_state"] if with_state else None
        kwargs = {} if chunk_size is None else {"chunk_size": chunk_size}
        out, final = fn(
            x["query"], x["key"], x["value"], x["g"], x["beta"], initial_state=state,
            output_final_state=True, use_qk_l2norm_in_kernel=True, **kwargs,
        )  # fmt: skip
        arrays = {name: t.numpy() for name, t in x.items() if with_state or name != "initial_state"}
        arrays |= {
            "out": out.numpy(),  # (B, L, H, Dv)
            "final_state": final.numpy(),  # (B, H, Dk, Dv)
            "chunk_size": np.array(-1 if chunk_size is None else chunk_size),
            "function": np.array(fn.__name__),
            "transformers_version": np.array(transformers.__version__),
        }
        path = GATED_DELTA_DIR / f"gated_delta_{case}.npz"
        np.savez_compressed(path, **arrays)
        print(f"{path.relative_to(GATED_DELTA_ROOT)}: {path.stat().st_size} bytes")


FAMILIES["gated_delta"] = make_gated_delta

# --- end of gated_delta ---------------------------------------------------------------------


def main(argv: list[str]) -> None:
    names = argv or list(FAMILIES)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise SystemExit(f"unknown families {unknown}; known: {sorted(FAMILIES)}")
    torch.manual_seed(0)
    for name in names:
        FAMILIES[name]()


if __name__ == "__main__":
    main(sys.argv[1:])
