from fastdiag.cli import main

main()
