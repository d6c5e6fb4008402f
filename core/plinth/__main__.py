import sys

try:
    from plinth.cli import main
except KeyboardInterrupt:  # Ctrl-C while the CLI module itself is imported
    sys.stderr.write("\n")
    sys.exit(130)

sys.exit(main())
