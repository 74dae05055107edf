"""A WAN on one machine: a swarm in containers whose links are shaped like a topology file's
(`hetpeer testbed`), and the Docker Compose driving that it and the compose tests share."""
