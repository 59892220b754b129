"""``python -m gpuflex`` is the ``gpuflex`` command."""

from gpuflex.cli.main import main

main()
