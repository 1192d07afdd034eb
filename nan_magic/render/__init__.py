"""Turn a Report into what people read: text, a table, figures, HTML, a widget.

Never imports torch. Nothing is imported here: ``Report`` loads each renderer
on first use, so ``import nan_magic`` stays free of pandas, matplotlib,
IPython and ipywidgets.
"""
