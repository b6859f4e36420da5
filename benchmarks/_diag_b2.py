# one-off diagnostic (not committed): compiled vs eager op inputs/outputs, qwen3 small, B=1 and 2, GPU
import sys, torch
sys.path.insert(0, ".")
from tests.runtime.test_static_step import _cache, D
from transformers import AutoConfig, AutoModelForCausalLM
from oscar_zoo.runtime import attention as A, compiled as C
from oscar_zoo.runtime.attention import enable_oscar
from oscar_zoo.runtime.compiled import CompiledLayers
rec = []
DEV = "cuda" if torch.cuda.is_available() else "cpu"
real = A.oscar_attention
def spy(module, query, key, value, *a, **k):
    out = real(module, query, key, value, *a, **k)
    if query.shape[2] == 1 and not torch.compiler.is_compiling():
        rec.append((module.layer_idx, query.clone(), key.clone(), value.clone(), out[0].clone(), query.stride(), key.stride(), out[0].stride()))
    return out
C_real = C.decode_attention
for mt in ("qwen3", "llama"):
  for B in (1, 2):
    cfg = AutoConfig.for_model(mt, vocab_size=512, hidden_size=144, intermediate_size=288, num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, head_dim=D, max_position_embeddings=2048, initializer_range=0.1)
    torch.manual_seed(0)
    model = enable_oscar(AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(DEV).float().eval(), compile=False)
    A.oscar_attention = spy
    from transformers import AttentionInterface
    AttentionInterface.register("oscar", spy)
    ids = torch.randint(0, 512, (B, 340), generator=torch.Generator().manual_seed(2)).to(DEV)
    res = []
    for comp in (False, True):
        rec.clear(); cache = _cache(2); cl = CompiledLayers(model)
        with torch.no_grad():
            model(ids[:, :330], cache=cache)
            for t in range(330, 333):
                if comp:
                    with cl.step(cache): lg = model(input_ids=ids[:, t:t+1], cache=cache).logits
                else: lg = model(input_ids=ids[:, t:t+1], cache=cache).logits
        res.append((list(rec), lg.float()))
    A.oscar_attention = real
    AttentionInterface.register("oscar", real)
    e, c = res
    print(mt, "B", B, "calls", len(e[0]), len(c[0]), "final logits maxdiff", (e[1]-c[1]).abs().max().item())
    for (le, qe, ke, ve, oe, qs, ks, os_), (lc, qc, kc, vc, oc, qsc, ksc, osc) in zip(e[0], c[0]):
        print(" layer", le, lc, "dq %.2e dk %.2e dv %.2e do %.2e" % ((qe-qc).abs().max(), (ke-kc).abs().max(), (ve-vc).abs().max(), (oe-oc).abs().max()), "strides e", qs, ks, os_, "c", qsc, ksc, osc)
