"""The IPython front end: %nanwatch and %%nantrace."""
