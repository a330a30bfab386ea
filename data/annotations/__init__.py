"""Labels as labelling tools export them: COCO, Labelme, CVAT, YOLO segmentation and Label Studio.

One reader per format (coco.py, labelme.py, cvat.py, yolo_seg.py, label_studio.py) turns the tool's files into
shapes (shapes.py), which are drawn into label masks as the tool draws them when an image is loaded
(dataset.py: the data set kinds `coco`, `labelme`, `cvat`, `yolo_seg`, `label_studio`); writers.py turns
predictions back into files the tools import. docs/own-data.md says what each kind reads and keeps.
"""
