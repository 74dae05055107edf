"""The contract between peers and coordinator: schemas and their wire forms. Imports nothing from hetpeer."""
