"""The jinja2 templates ``phx-port new`` renders (``phoenix.scaffold``); see README.md here."""
