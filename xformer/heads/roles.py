"""How many of a run's attention heads take each role inspect-heads measures, beside how many
the same architecture takes before training: the chance level of the ledger's "heads
specialise" claim.

The roles and their criteria are xformer.heads.stats' (positional, rare-word, special); a head
may hold several. The untrained model is the run's architecture initialised with the run's
seed, as training began (train.py seeds torch, then builds the model), read on the same
examples: what the criteria find in heads that have learned nothing.

    counts = role_counts(run_dir, n_examples=500)
    # {"heads": 24, "positional_heads": 5, "positional_heads_init": 0, "rare_word_heads": ...}
"""

from __future__ import annotations

from pathlib import Path

import torch

from xformer.config.loading import load_run_recipe
from xformer.heads import stats
from xformer.model.build import attention_modules
from xformer.tasks import make_task

ROLES = {"positional": "positional_heads", "rare-word": "rare_word_heads", "special": "special_heads"}


def role_counts(run_dir: str | Path, n_examples: int, *, checkpoint: str = "best", device: str = "cpu") -> dict:
    """{"heads": all heads, KEY: heads with the role, KEY_init: the same at initialisation} for
    every KEY of ROLES, on the first `n_examples` validation examples."""
    run_dir = Path(run_dir)
    recipe = load_run_recipe(run_dir)
    task = make_task(recipe)
    subject = task.subject(run_dir, split=None, data=None, n_examples=n_examples, checkpoint=checkpoint,
                           device=device)
    trained = _counts(subject)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.train.seed)
        untrained = task.build_model()
    subject.model.load_state_dict(untrained.state_dict())
    at_init = _counts(subject)
    return {"heads": trained.pop("heads"), **trained, **{f"{k}_init": v for k, v in at_init.items() if k != "heads"}}


def _counts(subject) -> dict:
    sites = attention_modules(subject.model)
    heads = [h for site in stats.collect(subject, sites, keep_examples=0)["heads"].values() for h in site]
    counts = {"heads": len(heads)}
    for role, key in ROLES.items():
        counts[key] = sum(any(r.startswith(role) for r in h["roles"]) for h in heads)
    return counts
