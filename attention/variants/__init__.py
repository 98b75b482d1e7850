"""One module per attention variant; each registers itself with ``@register``.

``attention/__init__.py`` imports every module in this folder, so adding a
variant is one file here plus one ``configs/attn/<name>.yaml``.
"""
