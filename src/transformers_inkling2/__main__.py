from transformers_inkling2_cli import main

main()
