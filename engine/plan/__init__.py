"""Before loading: what fits a card (the memory plan) and how fast it will run there."""
