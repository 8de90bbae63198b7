"""The Megatron -> HF conversion proved by a forward pass, for every architecture megatron-core builds
on CPU and the parallel layouts that matter for conversion (megatron_logits.py says what is compared
and why the tolerance holds).

    mpirun -np 2 python megatron_forward.py --configs DIR --cases llama:tp2,qwen3-moe:ep2,... --out DIR --port P

DIR/MODEL/config.json: the HF config of each model (wsync-model-gen --preset tiny; 4 layers for the
pp2acct, pp2uneven and pp2vpp2 cases' models). A case MODEL:LAYOUT, LAYOUT one of tp1 (TP 1, DP =
world), tp2 (with MoE: expert TP 2 too), ep2 (DP 2 for the dense part), tp2ep2 (TP 2, EP 2, expert
TP 1), pp2, and PP 2 split otherwise: pp2vpp2 (2 virtual stages per rank: 4 model chunks, each rank
holding a list of 2), pp2acct (account_for_embedding_in_pipeline_split and
account_for_loss_in_pipeline_split), pp2uneven (num_layers_in_first_pipeline_stage 1,
num_layers_in_last_pipeline_stage 3), pp2vpp2acct (both; with 2 layers, chunks of 0, 1, 1 and 0
layers: the first holds only the embedding, the last only the final norm and the output layer).
A MODEL named *-mtp is built with its config's MTP layers (megatron's MTP block; PP 1 layouts),
and its MTP layer's logits are checked too (megatron_logits.megatron_mtp_logits against
hf_mtp_logits, and every mtp_corruptions copy). For every case, on every rank:

1. a GPTModel (megatron's local spec, float32 parameters, parallel_output=False) of the config,
   initialised by megatron-core itself under torch.manual_seed(--seed) (use_cpu_initialization: each
   weight drawn whole by megatron's init_method, the rank's TP part taken), then: the routed experts
   redrawn the same way (megatron's _initialize_affine_weight_cpu with their init_method, the
   expert-TP rank's part kept) under a seed per global expert id (megatron's expert-parallel RNG
   tracker, which gives each EP rank its own stream, needs CUDA; without this both EP ranks would
   hold the same experts), the parameters megatron initialises to constants (RMSNorm weights 1, the
   QKV bias 0) given seeded random values around them (so that a conversion misplacing them changes
   the logits), every value rounded to bf16. No weight comes from wsync. The TP 2 model is then the
   TP 1 model bit for bit (and TP 2 x EP 2 the EP 2 one), which the test uses too;
2. the rank's weights dumped as a Megatron source directory (rank files under wsync's names,
   wsync.megatron.local_tensors; parallel.json from wsync.megatron.parallel_layout), and rank 0
   converts it with `wsync-shard --src DIR --to-hf HF` (the trainer agents' own gather and
   conversion: tools/synth/reassemble.h);
3. megatron's float32 logits of a seeded token batch (megatron_logits.megatron_logits: collective,
   pipeline stages in turn) against transformers' AutoModelForCausalLM.from_pretrained(HF) in
   float32 (megatron_logits.check), and against every corrupted copy of HF
   (megatron_logits.corruptions), each of which must fail.

A model megatron-core fails to build (DeepSeek-V3: MLA with the local spec) is recorded as
{case: {"build_error": ...}} on every rank (a failure on any rank counts) and the job goes on. Rank 0
writes OUT/results.json ({case: figures, the sha256 of the converted model.safetensors, the
parallel.json}) and prints one line per case; the pytest (test_megatron.py) asserts on them. Exit
status 0 once every case ran (the assertions are the test's).
"""

import argparse
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys
import time
import zlib

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "rl_loop"))
import megatron_cpu  # noqa: E402 (the CPU harness the example RL loop uses too)
import megatron_logits  # noqa: E402

_ACCOUNT = dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
# megatron_cpu.gpt_model's arguments; those of megatron_cpu.setup too (SETUP: the parallel state's)
LAYOUTS = {"tp1": dict(tp=1, ep=1, pp=1), "tp2": dict(tp=2, ep=1, pp=1), "ep2": dict(tp=1, ep=2, pp=1),
           "tp2ep2": dict(tp=2, ep=2, pp=1, etp=1), "pp2": dict(tp=1, ep=1, pp=2),
           "pp2vpp2": dict(tp=1, ep=1, pp=2, vpp=2), "pp2acct": dict(tp=1, ep=1, pp=2, **_ACCOUNT),
           "pp2uneven": dict(tp=1, ep=1, pp=2, num_layers_in_first_pipeline_stage=1,
                             num_layers_in_last_pipeline_stage=3),
           "pp2vpp2acct": dict(tp=1, ep=1, pp=2, vpp=2, **_ACCOUNT)}
SETUP = ("tp", "ep", "pp", "etp", "vpp")


def padded_vocab(vocab, tp, divisible_by=128):
    """Megatron-LM's padding (training/tokenizer: _vocab_size_with_padding): a multiple of
    make_vocab_size_divisible_by x TP."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def _generator(seed, what):
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{what}".encode()))


def seeded_weights(model, seed):
    """After megatron's own init (see the module docstring, step 1): experts redrawn per global id,
    constant-initialised parameters drawn around their constant, everything rounded to bf16.
    `model`: a GPTModel or the rank's list of virtual pipeline chunks, each seeded alike (every draw
    keyed by global layer numbers and expert ids, not by the chunk that holds the layer)."""
    for chunk in (model if isinstance(model, (list, tuple)) else [model]):
        _seeded_chunk(chunk, seed)


def _seeded_chunk(model, seed):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu

    tc = model.config
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    global_layer = {}  # local layer prefix -> global layer index (stages and chunks number theirs from 0)
    if getattr(model, "decoder", None) is not None:
        for i, layer in enumerate(model.decoder.layers):
            global_layer[f"decoder.layers.{i}."] = layer.layer_number - 1
            experts = getattr(getattr(layer.mlp, "experts", None), "local_experts", None)
            if experts is None:
                continue
            first = ps.get_expert_model_parallel_rank() * len(experts)
            etp, etp_rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
            for local, expert in enumerate(experts):
                for fc, init in (("linear_fc1", tc.init_method), ("linear_fc2", tc.output_layer_init_method)):
                    w = getattr(expert, fc).weight
                    dim = w.partition_dim
                    full = [w.shape[0], w.shape[1]]
                    full[dim] *= etp
                    expert_id = f"{seed}:layer{layer.layer_number - 1}:expert{first + local}:{fc}"
                    torch.manual_seed(zlib.crc32(expert_id.encode()))
                    # megatron's own CPU initialisation: the whole weight drawn, the expert-TP rank's part
                    # kept (fc1 with stride 2: its gate and up rows)
                    _initialize_affine_weight_cpu(w, full[0], full[1], w.shape[dim], dim, init, w.partition_stride,
                                                  params_dtype=w.dtype, rank=etp_rank, world_size=etp,
                                                  skip_set_tensor_parallel_attributes=True)
    with torch.no_grad():
        for name, b in model.named_buffers():  # the routers' expert_bias (fp32, zeros): seeded values
            if name.endswith("router.expert_bias"):
                m = re.match(r"^(decoder\.layers\.\d+\.)(.*)$", name)  # an MTP layer's: its own name
                key = f"layer{global_layer[m.group(1)]}.{m.group(2)}" if m else name
                b.copy_(0.1 * torch.randn(b.shape[0], generator=_generator(seed, key)))
        for name, p in model.named_parameters():
            m = re.match(r"^(decoder\.layers\.\d+\.)(.*)$", name)
            global_name = f"layer{global_layer[m.group(1)]}.{m.group(2)}" if m else name
            if p.dim() == 1 and bool((p == p.flatten()[0]).all()):  # a constant init: norm weights, biases
                sharded = getattr(p, "tensor_model_parallel", False)
                full = p.shape[0] * (tp if sharded else 1)
                g = _generator(seed, global_name)
                base = float(p.flatten()[0])
                values = base + (0.2 if base != 0 else 0.1) * torch.randn(full, generator=g)
                if sharded:  # the rank's part as megatron's CPU init takes it (fc1's bias: stride 2, gate and up)
                    stride = getattr(p, "partition_stride", 1)
                    values = torch.cat(values.split(p.shape[0] // stride)[tp_rank::tp])
                p.copy_(values)
            p.copy_(p.bfloat16())


def dump_source(model, cfg_text, out, rank):
    """The rank's weights as a Megatron source directory (bf16; the routers' expert_bias in fp32).
    A list of model chunks (virtual pipeline stages): one rank file, chunk c's names prefixed model{c}."""
    from safetensors.torch import save_file
    from wsync.megatron import local_tensors, parallel_layout

    parallel = parallel_layout(model)  # collective
    out.mkdir(parents=True, exist_ok=True)
    tensors = {n: (t.detach().float() if n.endswith("expert_bias") else t.detach().bfloat16()).contiguous()
               for n, t in local_tensors(model)}
    save_file(tensors, str(out / f"rank-{rank:05d}.safetensors"))
    if rank == 0:
        (out / "config.json").write_text(cfg_text)
        (out / "parallel.json").write_text(json.dumps(parallel))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", required=True)
    ap.add_argument("--cases", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", 0))
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", 1))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps

    cases = [tuple(c.split(":")) for c in a.cases.split(",")]
    out = pathlib.Path(a.out)
    results = {}
    for layout in LAYOUTS:
        models = [name for name, lay in cases if lay == layout]
        if not models:
            continue
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        megatron_cpu.setup(**{k: v for k, v in LAYOUTS[layout].items() if k in SETUP})
        for name in models:
            t0 = time.time()
            case = f"{name}:{layout}"
            cfg_path = pathlib.Path(a.configs) / name / "config.json"
            cfg = json.loads(cfg_path.read_text())
            torch.manual_seed(a.seed)
            error = None
            try:
                model = megatron_cpu.gpt_model(cfg, padded_vocab(cfg["vocab_size"], LAYOUTS[layout]["tp"]),
                                               **LAYOUTS[layout], dtype=torch.float32, parallel_output=False,
                                               mtp=name.endswith("-mtp"))
            except Exception as e:  # noqa: BLE001 (recorded: DeepSeek-V3's MLA does not build on CPU)
                error = f"{type(e).__name__}: {e}"
            # every rank learns of any rank's failure (some fail on one pipeline rank only)
            errors = [None] * world
            dist.all_gather_object(errors, error)
            if any(errors):
                results[case] = {"build_error": next(e for e in errors if e)}
                if rank == 0:
                    print(f"{case}: megatron-core does not build it: {results[case]['build_error']}", flush=True)
                continue
            seeded_weights(model, a.seed)
            src, hf = out / name / layout / "megatron", out / name / layout / "hf"
            dump_source(model, cfg_path.read_text(), src, rank)
            dist.barrier()
            if rank == 0:
                subprocess.run([os.path.join(os.environ["WSYNC_BIN"], "wsync-shard"), "--src", str(src), "--to-hf",
                                str(hf)], check=True, stdout=subprocess.DEVNULL)
            tokens = megatron_logits.tokens_for(cfg["vocab_size"])
            mtp_logits = None
            if name.endswith("-mtp"):  # PP 1 only: forward() is collective over TP alone
                logits, mtp_logits = megatron_logits.megatron_mtp_logits(model, tokens)
            else:
                logits = megatron_logits.megatron_logits(model, tokens)
            if rank == 0:
                r = megatron_logits.check(logits, hf, tokens)
                r["hf_sha256"] = hashlib.sha256((hf / "model.safetensors").read_bytes()).hexdigest()
                r["parallel"] = json.loads((src / "parallel.json").read_text())
                r["corrupted"] = {}
                for what, fn in megatron_logits.corruptions(cfg_path).items():
                    bad = megatron_logits.corrupt(hf, out / name / layout / f"hf-{what}", fn)
                    r["corrupted"][what] = megatron_logits.compare(logits,
                                                                   megatron_logits.hf_logits(bad, tokens))["rel"]
                if mtp_logits is not None:  # the MTP layer as the engines' draft models run it
                    r["mtp"] = megatron_logits.check_mtp(mtp_logits, hf, tokens)
                    r["mtp"]["corrupted"] = {
                        what: megatron_logits.compare(mtp_logits, megatron_logits.hf_mtp_logits(
                            megatron_logits.corrupt(hf, out / name / layout / f"hf-mtp-{what}", fn), tokens))["rel"]
                        for what, fn in megatron_logits.mtp_corruptions(cfg_path).items()}
                r["seconds"] = round(time.time() - t0, 2)
                results[case] = r
                worst = min(r["corrupted"].values())
                print(f"{case}: max|diff| {r['max_diff']:.3g} of logits up to {r['scale']:.3g} (rel {r['rel']:.3g}, "
                      f"fp32 noise {r['fp32_noise']:.3g}, tolerance {r['tolerance']:g}) "
                      f"{'ok' if r['ok'] else 'FAILED'}; {len(r['corrupted'])} corrupted copies: rel >= {worst:.3g}; "
                      f"{r['seconds']} s", flush=True)
                if "mtp" in r:
                    m = r["mtp"]
                    print(f"{case}: MTP layer: max|diff| {m['max_diff']:.3g} of logits up to {m['scale']:.3g} "
                          f"(rel {m['rel']:.3g}, fp32 noise {m['fp32_noise']:.3g}) {'ok' if m['ok'] else 'FAILED'}; "
                          f"{len(m['corrupted'])} corrupted copies: rel >= {min(m['corrupted'].values()):.3g}",
                          flush=True)
            dist.barrier()
    if rank == 0:
        (out / "results.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
