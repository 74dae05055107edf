"""`hetpeer swarm`: a coordinator and N peers on one machine, a bounded training run, and its report."""

from hetpeer.protocol.recipe import Recipe

# the demo's recipe: the tiny model on a few CPU peers learns fast at a higher rate, gossip's deadline is short on
# one machine, and the held-out loss is measured every 25 steps
DEMO_RECIPE = Recipe(lr=3e-3, mix_deadline_s=3.0, eval_every=25)
