"""The model and the loop of bench_train.py and bench_train_dist.py: a plain torch transformer
(embeddings, pre-norm blocks, final norm, a head over a 32000-token vocabulary) and the loop shapes
people write around it (`Loop`: --groups, --clip, --amp), the same for every row of a run."""
import importlib
import math

import torch
import torch.nn.functional as F

SIZES = {  # name: (dim, blocks, heads, batch, seq)
    "tiny": (128, 2, 4, 2, 64),
    "small": (1024, 8, 8, 8, 1024),
    "medium": (2048, 12, 16, 16, 1024),
    "large": (2560, 16, 20, 16, 1024),
}
VOCAB = 32000


class Block(torch.nn.Module):
    def __init__(self, dim, heads, exact):
        super().__init__()
        self.heads, self.exact = heads, exact
        self.ln1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim, bias=False)
        self.ln2 = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, 4 * dim, bias=False)
        self.fc2 = torch.nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(c, dim=2))
        if self.exact or not hasattr(F, "scaled_dot_product_attention"):
            # Plain attention: deterministic kernels only (--check-exact), and torch 1.13.
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            y = att.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Model(torch.nn.Module):
    def __init__(self, dim, blocks, heads, exact=False):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads, exact) for _ in range(blocks))
        self.ln = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens[:, :-1])
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.float().view(-1, VOCAB), tokens[:, 1:].reshape(-1))

    def param_groups(self, layout="block", weight_decay=0.1):
        """What the optimizers of a row get, as a loop with `--groups layout` writes it.
        block (or split): the embeddings, one group per block, then the final norm and the head (in
        forward order: a backward makes the head's grads final first, the embeddings' last). joined: one
        group per block, then one for the embeddings, the final norm and the head together. one:
        model.parameters() itself. decay: configure_optimizers' two groups (nanoGPT, HF Trainer): params
        of dim >= 2 with `weight_decay`, the others (biases, norms) with none."""
        if layout == "one":
            return self.parameters()
        if layout == "decay":
            params = [p for _, p in self.named_parameters() if p.requires_grad]
            return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                    {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        blocks = [{"params": list(b.parameters())} for b in self.blocks]
        head = list(self.ln.parameters()) + list(self.head.parameters())
        if layout == "joined":
            return blocks + [{"params": list(self.embed.parameters()) + head}]
        return [{"params": list(self.embed.parameters())}] + blocks + [{"params": head}]


LAYOUTS = ("block", "split", "joined", "one", "decay")  # --groups: Model.param_groups' layouts
CLIP_NORMS = {"none": None, "opt": 1.0e9, "reached": 1.0e-3}  # --clip: the max_norm of the clip calls


def make_grad_scaler(enabled):
    if hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler"):  # torch >= 2.3
        return torch.amp.GradScaler("cuda", enabled=enabled)
    return torch.cuda.amp.GradScaler(enabled=enabled)


class Loop:
    """The shape of a run's training loop (--groups, --clip, --amp): the param groups every row's
    optimizer gets, and the calls between the forward and the next one, as users write them."""

    def __init__(self, args):
        self.groups, self.clip, self.amp = args.groups, args.clip, args.amp
        self.max_norm = CLIP_NORMS[args.clip]
        self.autocast = args.amp == "fp16" and args.device == "cuda"  # on the CPU: the scaler disabled
        self.compile = getattr(args, "compile", False)
        self._compiled = {}  # id(model) -> torch.compile(model), made at its first forward

    def run(self, model, batch):
        """model(batch), through torch.compile(model) with --compile (one per model until fresh())."""
        if not self.compile:
            return model(batch)
        if id(model) not in self._compiled:
            self._compiled[id(model)] = torch.compile(model)
        return self._compiled[id(model)](batch)

    def fresh(self):
        """With --compile, the next forward compiles anew: after an optimizer's attach(), whose hooks
        a model compiled before ignores (torch.compile guards no hooks by default), as a user compiles
        once the optimizer is attached."""
        if self.compile:
            importlib.import_module("torch._dynamo").reset()
            self._compiled.clear()

    def label(self):
        return "%s, clip %s, amp %s%s" % (self.groups, self.clip, self.amp, ", compiled" if self.compile else "")

    def param_dtype(self):
        return torch.float32 if self.amp == "fp16" else torch.bfloat16

    def scaler(self):
        """A row's own GradScaler (each row starts from the same scale), or None without --amp."""
        return make_grad_scaler(self.autocast) if self.amp == "fp16" else None

    def forward_backward(self, model, batch, scaler):
        """Forward (under autocast with --amp fp16 on CUDA) and backward (of the scaled loss with a
        scaler) of `batch`. Returns the loss."""
        if self.autocast:
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                loss = self.run(model, batch)
        else:
            loss = self.run(model, batch)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        return loss

    def backward(self, model, batch, opt, kind, scaler, norms):
        """forward_backward, then the loop's clip call between backward and step (its norm appended to
        `norms`, a tensor: no host synchronization). Returns the loss."""
        loss = self.forward_backward(model, batch, scaler)
        if self.max_norm is not None:
            if kind == "torch":
                if scaler is not None:
                    scaler.unscale_(opt)  # torch's recipe: the clip sees the unscaled grads
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.max_norm)
            else:
                norm = opt.clip_grad_norm_(self.max_norm)  # no unscale_: ferry takes the scale itself
            norms.append(norm.detach().float().reshape(()))
        return loss

    @staticmethod
    def step(opt, scaler):
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()

    def clip_verdict(self, norms):
        """(text, ok): how many steps the clip reached, from the norms its calls returned; not ok when
        the mode's promise (--clip opt: never; reached: every step) does not hold."""
        if self.max_norm is None or not norms:
            return "", True
        n = torch.stack(norms).cpu()
        finite = n[torch.isfinite(n)]
        if finite.numel() == 0:
            return "clip: no finite norm in %d steps" % n.numel(), True
        reached = int((finite > self.max_norm).sum())
        ok = reached == finite.numel() if self.clip == "reached" else reached == 0
        return "clip reached in %d of %d steps (norm %.3g to %.3g)%s" % (
            reached, finite.numel(), float(finite.min()), float(finite.max()),
            "" if ok else ": NOT what --clip %s promises" % self.clip), ok
