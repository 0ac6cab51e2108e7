"""Sharing results across hosts: the client of the fleet service."""
