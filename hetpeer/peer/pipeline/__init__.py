"""The stage worker and its micro-batch schedule."""
