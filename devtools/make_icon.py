"""Draw the pack's registry icon, docs/img/icon.png (400x400: within the registry's 800x400).

A fine grid of tokens, an arrow, the same area as a coarser grid (what ToDo does to keys and
values), between a long bar and a shorter one (the time of a step before and after).

    <host python> devtools/make_icon.py      # needs Pillow (the ComfyUI host's venv has it)
"""

from pathlib import Path

from PIL import Image, ImageDraw

OUT = Path(__file__).resolve().parent.parent / "docs" / "img" / "icon.png"
SIZE = 400
BACKGROUND = (24, 28, 38, 255)
TOKENS = [(64, 156, 255), (92, 200, 255), (120, 110, 255), (80, 220, 190)]
ARROW = (240, 180, 41, 255)


def grid(draw, left: int, top: int, cells: int, cell: int, gap: int, radius: int, colour) -> None:
    for row in range(cells):
        for col in range(cells):
            x, y = left + col * (cell + gap), top + row * (cell + gap)
            draw.rounded_rectangle((x, y, x + cell, y + cell), radius=radius, fill=colour(row, col))


def main() -> None:
    image = Image.new("RGBA", (SIZE, SIZE), (0, 0, 0, 0))
    draw = ImageDraw.Draw(image)
    draw.rounded_rectangle((0, 0, SIZE - 1, SIZE - 1), radius=64, fill=BACKGROUND)
    left, top, cell, gap = 36, 110, 26, 5
    grid(draw, left, top, 6, cell, gap, 5, lambda r, c: TOKENS[(r * 7 + c * 3) % 4])  # all the tokens
    arrow_x, arrow_y = left + 6 * (cell + gap) + 8, top + 3 * (cell + gap) - gap // 2
    draw.polygon([(arrow_x, arrow_y - 22), (arrow_x + 34, arrow_y), (arrow_x, arrow_y + 22)], fill=ARROW)
    grid(draw, arrow_x + 48, top, 3, 2 * cell + gap, gap, 8, lambda r, c: TOKENS[(r * 2 + c) % 4])  # pooled
    draw.rounded_rectangle((36, 40, 364, 70), radius=12, fill=TOKENS[0])  # a step's time before
    draw.rounded_rectangle((36, 330, 200, 360), radius=12, fill=ARROW)  # and after
    image.save(OUT, optimize=True)
    print(OUT, image.size)


if __name__ == "__main__":
    main()
