"""What the streaming parsers share: how much of a text's tail might still become a marker."""


def held_suffix_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers`.

    A streaming parser holds that tail back: the next delta may complete the marker
    (`"...<thi"` + `"nk>"`), and text once emitted cannot be taken back.
    """
    best = 0
    for marker in markers:
        for n in range(min(len(text), len(marker) - 1), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best
