"""The class names, colours and label tables of the built-in data set kinds, as plain Python.

syncseg.data.registry reads them to describe each kind (class count, palette) without importing the data
set modules (torch, cv2); the modules (voc.py, cityscapes.py, ade20k.py, synthetic.py) build their numpy
palettes and lookup tables from them.
"""
from __future__ import annotations

VOC_CLASSES = (
    "background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
    "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train", "tvmonitor",
)

CITYSCAPES_TABLE_IGNORE = 255  # the official tables' trainId for labels left out of training and evaluation

# (labelId, trainId, name, color) for every labelId 0..33; trainId 255 = ignored in training/evaluation.
CITYSCAPES_LABELS = (
    (0, 255, "unlabeled", (0, 0, 0)),
    (1, 255, "ego vehicle", (0, 0, 0)),
    (2, 255, "rectification border", (0, 0, 0)),
    (3, 255, "out of roi", (0, 0, 0)),
    (4, 255, "static", (0, 0, 0)),
    (5, 255, "dynamic", (111, 74, 0)),
    (6, 255, "ground", (81, 0, 81)),
    (7, 0, "road", (128, 64, 128)),
    (8, 1, "sidewalk", (244, 35, 232)),
    (9, 255, "parking", (250, 170, 160)),
    (10, 255, "rail track", (230, 150, 140)),
    (11, 2, "building", (70, 70, 70)),
    (12, 3, "wall", (102, 102, 156)),
    (13, 4, "fence", (190, 153, 153)),
    (14, 255, "guard rail", (180, 165, 180)),
    (15, 255, "bridge", (150, 100, 100)),
    (16, 255, "tunnel", (150, 120, 90)),
    (17, 5, "pole", (153, 153, 153)),
    (18, 255, "polegroup", (153, 153, 153)),
    (19, 6, "traffic light", (250, 170, 30)),
    (20, 7, "traffic sign", (220, 220, 0)),
    (21, 8, "vegetation", (107, 142, 35)),
    (22, 9, "terrain", (152, 251, 152)),
    (23, 10, "sky", (70, 130, 180)),
    (24, 11, "person", (220, 20, 60)),
    (25, 12, "rider", (255, 0, 0)),
    (26, 13, "car", (0, 0, 142)),
    (27, 14, "truck", (0, 0, 70)),
    (28, 15, "bus", (0, 60, 100)),
    (29, 255, "caravan", (0, 0, 90)),
    (30, 255, "trailer", (0, 0, 110)),
    (31, 16, "train", (0, 80, 100)),
    (32, 17, "motorcycle", (0, 0, 230)),
    (33, 18, "bicycle", (119, 11, 32)),
)

# the 19 classes trained and evaluated (trainIds 0..18) and their colours
_CITYSCAPES_TRAINED = [(name, colour) for _, train_id, name, colour in CITYSCAPES_LABELS
                       if train_id != CITYSCAPES_TABLE_IGNORE]
CITYSCAPES_CLASSES = tuple(name for name, _ in _CITYSCAPES_TRAINED)
CITYSCAPES_COLOURS = tuple(colour for _, colour in _CITYSCAPES_TRAINED)

# (class name, color) for classes 0..149, i.e. raw annotation values 1..150
ADE20K_CLASSES_AND_COLOURS = (
    ('wall', (120, 120, 120)), ('building', (180, 120, 120)), ('sky', (6, 230, 230)), ('floor', (80, 50, 50)),
    ('tree', (4, 200, 3)), ('ceiling', (120, 120, 80)), ('road', (140, 140, 140)), ('bed', (204, 5, 255)),
    ('windowpane', (230, 230, 230)), ('grass', (4, 250, 7)), ('cabinet', (224, 5, 255)),
    ('sidewalk', (235, 255, 7)), ('person', (150, 5, 61)), ('earth', (120, 120, 70)), ('door', (8, 255, 51)),
    ('table', (255, 6, 82)), ('mountain', (143, 255, 140)), ('plant', (204, 255, 4)), ('curtain', (255, 51, 7)),
    ('chair', (204, 70, 3)), ('car', (0, 102, 200)), ('water', (61, 230, 250)), ('painting', (255, 6, 51)),
    ('sofa', (11, 102, 255)), ('shelf', (255, 7, 71)), ('house', (255, 9, 224)), ('sea', (9, 7, 230)),
    ('mirror', (220, 220, 220)), ('rug', (255, 9, 92)), ('field', (112, 9, 255)), ('armchair', (8, 255, 214)),
    ('seat', (7, 255, 224)), ('fence', (255, 184, 6)), ('desk', (10, 255, 71)), ('rock', (255, 41, 10)),
    ('wardrobe', (7, 255, 255)), ('lamp', (224, 255, 8)), ('bathtub', (102, 8, 255)), ('railing', (255, 61, 6)),
    ('cushion', (255, 194, 7)), ('base', (255, 122, 8)), ('box', (0, 255, 20)), ('column', (255, 8, 41)),
    ('signboard', (255, 5, 153)), ('chest of drawers', (6, 51, 255)), ('counter', (235, 12, 255)),
    ('sand', (160, 150, 20)), ('sink', (0, 163, 255)), ('skyscraper', (140, 140, 140)),
    ('fireplace', (250, 10, 15)), ('refrigerator', (20, 255, 0)), ('grandstand', (31, 255, 0)),
    ('path', (255, 31, 0)), ('stairs', (255, 224, 0)), ('runway', (153, 255, 0)), ('case', (0, 0, 255)),
    ('pool table', (255, 71, 0)), ('pillow', (0, 235, 255)), ('screen door', (0, 173, 255)),
    ('stairway', (31, 0, 255)), ('river', (11, 200, 200)), ('bridge', (255, 82, 0)), ('bookcase', (0, 255, 245)),
    ('blind', (0, 61, 255)), ('coffee table', (0, 255, 112)), ('toilet', (0, 255, 133)), ('flower', (255, 0, 0)),
    ('book', (255, 163, 0)), ('hill', (255, 102, 0)), ('bench', (194, 255, 0)), ('countertop', (0, 143, 255)),
    ('stove', (51, 255, 0)), ('palm', (0, 82, 255)), ('kitchen island', (0, 255, 41)), ('computer', (0, 255, 173)),
    ('swivel chair', (10, 0, 255)), ('boat', (173, 255, 0)), ('bar', (0, 255, 153)),
    ('arcade machine', (255, 92, 0)), ('hovel', (255, 0, 255)), ('bus', (255, 0, 245)), ('towel', (255, 0, 102)),
    ('light', (255, 173, 0)), ('truck', (255, 0, 20)), ('tower', (255, 184, 184)), ('chandelier', (0, 31, 255)),
    ('awning', (0, 255, 61)), ('streetlight', (0, 71, 255)), ('booth', (255, 0, 204)),
    ('television receiver', (0, 255, 194)), ('airplane', (0, 255, 82)), ('dirt track', (0, 10, 255)),
    ('apparel', (0, 112, 255)), ('pole', (51, 0, 255)), ('land', (0, 194, 255)), ('bannister', (0, 122, 255)),
    ('escalator', (0, 255, 163)), ('ottoman', (255, 153, 0)), ('bottle', (0, 255, 10)), ('buffet', (255, 112, 0)),
    ('poster', (143, 255, 0)), ('stage', (82, 0, 255)), ('van', (163, 255, 0)), ('ship', (255, 235, 0)),
    ('fountain', (8, 184, 170)), ('conveyer belt', (133, 0, 255)), ('canopy', (0, 255, 92)),
    ('washer', (184, 0, 255)), ('plaything', (255, 0, 31)), ('swimming pool', (0, 184, 255)),
    ('stool', (0, 214, 255)), ('barrel', (255, 0, 112)), ('basket', (92, 255, 0)), ('waterfall', (0, 224, 255)),
    ('tent', (112, 224, 255)), ('bag', (70, 184, 160)), ('minibike', (163, 0, 255)), ('cradle', (153, 0, 255)),
    ('oven', (71, 255, 0)), ('ball', (255, 0, 163)), ('food', (255, 204, 0)), ('step', (255, 0, 143)),
    ('tank', (0, 255, 235)), ('trade name', (133, 255, 0)), ('microwave', (255, 0, 235)), ('pot', (245, 0, 255)),
    ('animal', (255, 0, 122)), ('bicycle', (255, 245, 0)), ('lake', (10, 190, 212)), ('dishwasher', (214, 255, 0)),
    ('screen', (0, 204, 255)), ('blanket', (20, 0, 255)), ('sculpture', (255, 255, 0)), ('hood', (0, 153, 255)),
    ('sconce', (0, 41, 255)), ('vase', (0, 255, 204)), ('traffic light', (41, 0, 255)), ('tray', (41, 255, 0)),
    ('ashcan', (173, 0, 255)), ('fan', (0, 245, 255)), ('pier', (71, 0, 255)), ('crt screen', (122, 0, 255)),
    ('plate', (0, 255, 184)), ('monitor', (0, 92, 255)), ('bulletin board', (184, 255, 0)),
    ('shower', (0, 133, 255)), ('radiator', (255, 214, 0)), ('glass', (25, 194, 194)), ('clock', (102, 255, 0)),
    ('flag', (92, 0, 255)),
)

ADE20K_CLASSES = tuple(name for name, _ in ADE20K_CLASSES_AND_COLOURS)
ADE20K_COLOURS = tuple(colour for _, colour in ADE20K_CLASSES_AND_COLOURS)

# the synthetic data set's shapes: class k is SHAPE_NAMES[k - 1], class 0 the background
SHAPE_NAMES = ("disc", "rectangle", "triangle", "ring", "cross", "star", "hexagon")
SYNTHETIC_DEFAULT_NUM_CLASSES = 6  # background + the first five shapes
SYNTHETIC_CLASSES = ("background",) + SHAPE_NAMES  # data.num_classes=N takes the first N
