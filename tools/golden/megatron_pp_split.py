"""Golden layer splits of megatron-core itself, for wsync's MegatronChunkLayers
(src/trainer_agent/convert/source_parallel.h; MEGATRON_TO_HF.md §4.2).

    build/venv-torch/bin/python tools/golden/megatron_pp_split.py --out tests/data/golden

For a grid of num_layers x pp x vpp x Megatron's split options, builds megatron-core's own
TransformerConfig (its __post_init__ checks run) and calls its get_num_layers_to_build and
get_transformer_layer_offset for every (pipeline rank, virtual stage). Writes
megatron_pp_split.json: one record per line, either {"refused": reason} (TransformerConfig or
get_num_layers_to_build raised) or {"layers": [...]} with {"offsets": [...]} or, where
get_transformer_layer_offset raised, {"offset_error": reason}; lists in chunk order (chunk k =
virtual stage k // pp of pipeline rank k % pp). Nothing here uses wsync code;
the output is deterministic (the megatron-core version is recorded in the file).
"""

import argparse
import itertools
import json
import os

import torch
from megatron.core import package_info
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset


def case(num_layers, pp, vpp, first, last, embedding, loss):
    kw = dict(num_layers=num_layers, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=pp,
              pipeline_dtype=torch.float32, virtual_pipeline_model_parallel_size=vpp,
              num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
              account_for_embedding_in_pipeline_split=embedding, account_for_loss_in_pipeline_split=loss)
    rec = {"num_layers": num_layers, "pp": pp, "vpp": vpp or 1, "first": first, "last": last,
           "embedding": embedding, "loss": loss}
    try:
        config = TransformerConfig(**kw)
    except Exception as e:  # noqa: BLE001 (Megatron's refusal is the golden value)
        rec["refused"] = f"TransformerConfig: {type(e).__name__}: {e}"
        return rec
    chunks = [(v, r) for v in range(vpp or 1) for r in range(pp)]
    layers, offsets = [], []
    for v, r in chunks:
        try:
            layers.append(get_num_layers_to_build(config, vp_stage=v if vpp else None, pp_rank=r))
        except Exception as e:  # noqa: BLE001
            rec["refused"] = f"get_num_layers_to_build, pp rank {r}, virtual stage {v}: {type(e).__name__}: {e}"
            return rec
    rec["layers"] = layers
    for v, r in chunks:
        try:
            offsets.append(get_transformer_layer_offset(config, vp_stage=v if vpp else None, pp_rank=r))
        except Exception as e:  # noqa: BLE001 (recorded beside the layers it could not place)
            rec["offset_error"] = f"get_transformer_layer_offset, pp rank {r}, virtual stage {v}: {type(e).__name__}: {e}"
            return rec
    rec["offsets"] = offsets
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    cases = []
    for num_layers, pp, vpp in itertools.product((2, 3, 4, 5, 6, 8, 12), (1, 2, 3, 4), (None, 2, 3)):
        if vpp and pp == 1:
            continue
        for first, last in itertools.product((None, 1, 2, 3, 4), repeat=2):
            for embedding, loss in itertools.product((False, True), repeat=2):
                if (first or last) and (embedding or loss) and (num_layers, pp, vpp) != (4, 2, None):
                    continue  # refused by Megatron whatever the sizes: one example is enough
                cases.append(case(num_layers, pp, vpp, first, last, embedding, loss))
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "megatron_pp_split.json")
    with open(path, "w") as f:
        f.write(f'{{"megatron_core": "{package_info.__version__}", "cases": [\n')
        f.write(",\n".join(json.dumps(c, separators=(",", ":")) for c in cases))
        f.write("\n]}\n")
    ok = sum("refused" not in c for c in cases)
    print(f"wrote {len(cases)} cases ({ok} built, {len(cases) - ok} refused) to {path}")


if __name__ == "__main__":
    main()
