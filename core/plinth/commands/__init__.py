"""Built-in ``plinth`` subcommands, one module each with ``register(subparsers)``."""
