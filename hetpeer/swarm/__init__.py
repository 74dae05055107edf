"""`hetpeer swarm`: a coordinator and N peers on one machine, a bounded training run, and its report."""
