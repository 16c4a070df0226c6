"""Engines for this area land here (see DESIGN.md §3); nothing in them imports megatron."""
