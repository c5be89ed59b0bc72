"""README's "Distill your own pair" CPU recipe over seeds: scripts/pair_recipe.py's own paragraph and table."""

from __future__ import annotations

from ..common import Figure, _read_json, module, script

PAIR = ("python scripts/pair_recipe.py --out {out} --seeds 0,1,2,3,4 --set student.keep_layers=0:12,18:30"
        " --set optim.learning_rate=3e-5 --set optim.total_steps=0 --set train.steps=20 --set train.eval_every=5"
        " --set task.num_eval=16")


FIGURES: dict[str, Figure] = {
    "pair_recipe": Figure((PAIR,), _read_json("pair_recipe.json"), {"table": script("pair_recipe", "markdown")},
                          images=(("docs/figures/pair_recipe.png",
                                   lambda res, path: module("pair_recipe").plot(res, path)),)),
}
