"""AdamW that keeps, per parameter, an fp32 master copy and both moments as plain tensors of the
parameter's shape, so FlexTP migration can move a unit's slices of all of them with its weights.
Same update as torch.optim.AdamW (decoupled weight decay, bias correction)."""
from __future__ import annotations

import torch


class FlexAdamW:
    FIELDS = ("master", "exp_avg", "exp_avg_sq")

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, no_decay=()):
        self.params = list(params)
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.no_decay = {id(p) for p in no_decay}
        self.steps = 0
        self.state = {}
        for p in self.params:
            master = p.detach().float().clone()
            self.state[p] = {"master": master, "exp_avg": torch.zeros_like(master),
                             "exp_avg_sq": torch.zeros_like(master)}

    def fields(self, p) -> list[torch.Tensor]:
        return [self.state[p][name] for name in self.FIELDS]

    def replace(self, old, new, tensors) -> None:
        """`new` takes `old`'s place (a resharded parameter) with these field tensors."""
        self.params[next(i for i, p in enumerate(self.params) if p is old)] = new
        del self.state[old]
        self.state[new] = dict(zip(self.FIELDS, tensors))
        if id(old) in self.no_decay:
            self.no_decay = (self.no_decay - {id(old)}) | {id(new)}

    @torch.no_grad()
    def step(self, lr: float | None = None) -> None:
        lr = self.lr if lr is None else lr
        b1, b2 = self.betas
        self.steps += 1
        c1, c2 = 1 - b1 ** self.steps, 1 - b2 ** self.steps
        for p in self.params:
            if p.grad is None:
                continue
            st = self.state[p]
            g = p.grad.float()
            if self.weight_decay and id(p) not in self.no_decay:
                st["master"].mul_(1 - lr * self.weight_decay)
            st["exp_avg"].lerp_(g, 1 - b1)
            st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (st["exp_avg_sq"] / c2).sqrt_().add_(self.eps)
            st["master"].addcdiv_(st["exp_avg"], denom, value=-lr / c1)
            p.copy_(st["master"])

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
