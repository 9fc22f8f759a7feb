from ledger_cdc.cli import main

main()
