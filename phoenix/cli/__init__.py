"""Command-line tools: phx (operators) and phx-port (porters)."""
