"""The coordinator: turns peers' announcements into plans (planner/) and serves them."""
