"""`python -m specedge`: the `specedge` command."""

from specedge.launch import main

main()
