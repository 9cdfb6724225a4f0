"""Pipelines on their own (no sockets, no processes): geometry, declarations, errors, randomness."""

from __future__ import annotations

import textwrap

import cv2
import numpy as np
import pytest

from stoker.producer.serve.batch_slots import SlotLayout, sample_rows
from stoker.producer.images.builtin_pipelines import make_detection, make_imagenet, make_segmentation
from stoker.producer.pipeline import Field, Pipeline, PipelineError, SampleError, load_pipeline, upto
from stoker.producer.serve.sharding import RecordRng
from stoker.producer.dataset.build.synthetic import class_colour, synthetic_record, synthetic_scene


def _rows(pipeline: Pipeline, batch: int = 1) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    layout = SlotLayout(pipeline.batch_arrays(), batch, slots=1)
    arrays = layout.views(bytearray(layout.slot_bytes))[0]
    return arrays, sample_rows(arrays)


def _clean_scene(seed: int, classes: int = 5) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A synthetic scene's shapes on black, lossless: object pixels are exactly their class colour."""
    _, boxes, labels, label_map = synthetic_scene(seed, 0, classes)
    image = np.zeros((*label_map.shape, 3), np.uint8)
    for k in range(classes):
        image[label_map == k + 1] = np.round(class_colour(k, classes)).astype(np.uint8)
    return image, boxes, labels, label_map


def _png(image: np.ndarray) -> bytes:
    return cv2.imencode(".png", image)[1].tobytes()


@pytest.mark.parametrize("seed", range(12))
def test_detection_boxes_still_enclose_the_drawn_objects_after_augmentation(seed):
    image, boxes, classes, _ = _clean_scene(seed)
    record = {"image": _png(image), "boxes": boxes, "classes": classes}
    pipeline = make_detection(mode="train", size="96x128", min_scale=0.5)
    _, rows = _rows(pipeline)
    row = rows[0]
    pipeline.write(record, np.random.default_rng(seed), row)
    n = int(row["boxes_len"])
    assert n == len(boxes), "a crop that keeps boxes must keep every one"
    out = row["images"].astype(int)
    for box, label in zip(row["boxes"][:n], row["classes"][:n]):
        colour = np.round(class_colour(int(label), 5)).astype(int)
        # BGR in the scene, RGB out of the decoder
        near = np.abs(out - colour[::-1]).sum(axis=2) < 60
        ys, xs = np.nonzero(near)
        x1, y1, x2, y2 = box
        inside = (xs >= x1 - 1.5) & (xs < x2 + 1.5) & (ys >= y1 - 1.5) & (ys < y2 + 1.5)
        assert inside.any(), "the object is not where its box says"
        # every pixel of this colour inside some box of this class (objects of one class may repeat)
        same = [b for b, c in zip(row["boxes"][:n], row["classes"][:n]) if c == label]
        covered = np.zeros_like(inside)
        for bx1, by1, bx2, by2 in same:
            covered |= (xs >= bx1 - 1.5) & (xs < bx2 + 1.5) & (ys >= by1 - 1.5) & (ys < by2 + 1.5)
        assert covered.all(), "object pixels outside every box of their class"
        # tight: the object's own pixels reach the box's edges
        own_x, own_y = xs[inside], ys[inside]
        assert own_x.min() <= x1 + 2 and own_x.max() >= x2 - 3 and own_y.min() <= y1 + 2 and own_y.max() >= y2 - 3
    assert (row["boxes"][n:] == 0).all() and (row["classes"][n:] == 0).all(), "padding must be zeros"


def test_detection_drops_empty_boxes_clips_the_rest_and_names_too_many():
    image, boxes, classes, _ = _clean_scene(3)
    h, w = image.shape[:2]
    noisy = np.concatenate([boxes, [[10, 10, 10, 40], [-20, -5, 30, 25], [np.nan, 0, 5, 5]]]).astype(np.float32)
    record = {"image": _png(image), "boxes": noisy, "classes": np.concatenate([classes, [1, 2, 3]])}
    pipeline = make_detection(mode="eval", size=64)
    _, rows = _rows(pipeline)
    pipeline.write(record, np.random.default_rng(0), rows[0])
    n = int(rows[0]["boxes_len"])
    assert n == len(boxes) + 1  # the zero-width and the NaN box dropped, the partly outside one clipped
    kept = rows[0]["boxes"][:n]
    assert kept.min() >= 0 and kept[:, [0, 2]].max() <= 64 and kept[:, [1, 3]].max() <= 64
    np.testing.assert_allclose(kept[-1], [0, 0, 30 * 64 / w, 25 * 64 / h], rtol=1e-5)
    small = make_detection(mode="eval", size=64, max_boxes=1)
    _, rows = _rows(small)
    with pytest.raises(SampleError, match=r"more than max_boxes=1.*--pipeline-arg max_boxes"):
        small.write(record, np.random.default_rng(0), rows[0])


@pytest.mark.parametrize("seed", range(8))
def test_segmentation_mask_still_matches_the_image_shapes_after_augmentation(seed):
    image, _, _, label_map = _clean_scene(seed)
    pipeline = make_segmentation(mode="train", size="80x64")
    _, rows = _rows(pipeline)
    pipeline.write({"image": _png(image), "mask": _png(label_map)}, np.random.default_rng(seed), rows[0])
    out, mask = rows[0]["images"].astype(int), rows[0]["masks"]
    assert mask.shape == (80, 64) and set(np.unique(mask)) <= set(np.unique(label_map))
    expected = np.zeros_like(out)
    for k in range(5):
        expected[mask == k + 1] = np.round(class_colour(k, 5)).astype(int)[::-1]
    agree = (np.abs(out - expected).sum(axis=2) < 60).mean()
    assert agree > 0.95, f"mask and image agree on only {agree:.1%} of pixels"


def test_synthetic_detection_and_segmentation_records_describe_what_is_drawn():
    for index in range(6):
        det = synthetic_record("detection", 0, index, 10)
        seg = synthetic_record("segmentation", 0, index, 10)
        assert det["image"] == seg["image"]
        rgb = cv2.imdecode(np.frombuffer(det["image"], np.uint8), cv2.IMREAD_COLOR).astype(int)
        labels = cv2.imdecode(np.frombuffer(seg["mask"], np.uint8), cv2.IMREAD_UNCHANGED)
        assert labels.shape == rgb.shape[:2] and len(det["boxes"]) >= 1
        for (x1, y1, x2, y2), label in zip(det["boxes"].astype(int), det["classes"]):
            inside = labels[y1:y2, x1:x2]
            assert (inside == label + 1).mean() > 0.7  # a rectangle fills it, an ellipse ~79%
            ys, xs = np.nonzero(labels == label + 1)
            assert ((xs >= x1) & (xs < x2) & (ys >= y1) & (ys < y2)).any()
            colour = np.array(class_colour(int(label), 10))
            drawn = rgb[labels == label + 1]
            own = drawn[(np.nonzero(labels == label + 1)[1] >= x1) & (np.nonzero(labels == label + 1)[1] < x2)]
            assert np.abs(own.mean(axis=0) - colour).max() < 25, "the box's pixels are not its class colour"


def test_imagenet_options_shape_the_output():
    record = {"image": synthetic_record("classification", 0, 0, 4)["image"], "label": 3}
    for mode in ("train", "eval"):
        pipeline = make_imagenet(mode=mode, size="48x80", scale="0.5,1", ratio="1,2", eval_crop=1.0)
        arrays, rows = _rows(pipeline)
        pipeline.write(record, np.random.default_rng(1), rows[0])
        assert arrays["images"].shape == (1, 48, 80, 3) and int(rows[0]["labels"]) == 3
    no_flip = make_imagenet(mode="train", image_size=32, flip=False)
    _, rows = _rows(no_flip)
    seen = set()
    for _ in range(2):
        no_flip.write(record, np.random.default_rng(7), rows[0])
        seen.add(rows[0]["images"].tobytes())
    assert len(seen) == 1
    with pytest.raises(PipelineError, match="scale '2,3'"):
        make_imagenet(scale="2,3")
    with pytest.raises(SampleError, match="'label' is -1"):
        make_imagenet(image_size=16).write({"image": record["image"], "label": -1}, np.random.default_rng(0),
                                           _rows(make_imagenet(image_size=16))[1][0])


def _sample_pipeline(fn) -> Pipeline:
    return Pipeline([Field("x", "float32", (2,)), Field("boxes", "float32", (upto(3), 4)), Field("n", "int32")],
                    sample=fn)


@pytest.mark.parametrize("made, message", [
    ({"x": np.zeros(2, np.float64), "boxes": np.zeros((1, 4), np.float32), "n": 1},
     r"field 'x' is float64, the pipeline declares float32 \(convert it with .astype\(np.float32\)\)"),
    ({"x": np.zeros(3, np.float32), "boxes": np.zeros((1, 4), np.float32), "n": 1},
     r"field 'x' has shape \[3\], the pipeline declares \[2\]"),
    ({"x": np.zeros(2, np.float32), "boxes": np.zeros((4, 4), np.float32), "n": 1},
     r"field 'boxes' has 4 rows, more than the 3 declared \(upto\(3\)\)"),
    ({"x": np.zeros(2, np.float32), "boxes": np.zeros((1, 5), np.float32), "n": 1},
     r"field 'boxes' has shape \[1, 5\], the pipeline declares \[<=3, 4\]"),
    ({"x": np.zeros(2, np.float32), "n": 1}, r"missing \['boxes'\]"),
    ({"x": np.zeros(2, np.float32), "boxes": np.zeros((1, 4), np.float32), "n": 1, "y": 2}, r"undeclared \['y'\]"),
    ({"x": np.zeros(2, np.float32), "boxes": np.zeros((1, 4), np.float32), "n": 2**40}, r"field 'n'.*does not fit int32"),
    ({"x": np.zeros(2, np.float32), "boxes": np.zeros((1, 4), np.float32), "n": "one"}, r"field 'n' is str"),
    ([1, 2, 3], r"returned list, expected a dict of x, boxes, n"),
])
def test_a_sample_that_does_not_match_its_fields_is_named(made, message):
    pipeline = _sample_pipeline(lambda record, rng: made)
    _, rows = _rows(pipeline)
    with pytest.raises(SampleError, match=message):
        pipeline.write({}, np.random.default_rng(0), rows[0])


def test_a_good_sample_is_padded_with_its_length_and_python_values_are_converted():
    pipeline = _sample_pipeline(lambda record, rng: {"x": [1.5, 2], "boxes": np.ones((2, 4), np.float32), "n": 7})
    arrays, rows = _rows(pipeline, batch=2)
    rows[1]["boxes"][...] = 9  # stale data in the slot must not survive
    pipeline.write({}, np.random.default_rng(0), rows[1])
    assert arrays["x"][1].tolist() == [1.5, 2.0] and int(arrays["n"][1]) == 7 and int(arrays["boxes_len"][1]) == 2
    assert (arrays["boxes"][1, :2] == 1).all() and (arrays["boxes"][1, 2:] == 0).all()


def test_a_raising_pipeline_function_becomes_a_sample_error_naming_the_exception():
    def broken(record, rng):
        raise KeyError("bbox")

    pipeline = _sample_pipeline(broken)
    with pytest.raises(SampleError, match="sample function raised KeyError: 'bbox'"):
        pipeline.write({}, np.random.default_rng(0), _rows(pipeline)[1][0])


@pytest.mark.parametrize("fields, message", [
    ([], "at least one field"),
    ([Field("index", "int64")], "'index' is reserved"),
    ([Field("a", "uint8"), Field("a", "uint8")], "'a' is declared twice"),
    ([Field("a b", "uint8")], "must match"),
    ([Field("a", "uint8", (3, upto(4)))], "only the first dimension may be upto"),
    ([Field("a", "uint8", (-1,))], "must be an integer >= 0"),
    ([Field("a", "float32", (upto(2),)), Field("a_len", "int32")], "clashes with the length"),
])
def test_invalid_declarations_are_refused_when_the_pipeline_is_made(fields, message):
    with pytest.raises(PipelineError, match=message):
        Pipeline(fields, sample=lambda r, g: {})


def test_field_dtypes_are_checked_against_what_can_travel():
    with pytest.raises(PipelineError, match="dtype complex64 cannot travel"):
        Field("z", "complex64")
    with pytest.raises(PipelineError, match="is not a numpy dtype"):
        Field("z", "nonsense")


def test_pipelines_load_from_a_file_with_typed_arguments_and_loading_errors_are_named(tmp_path):
    source = tmp_path / "mine.py"
    source.write_text(textwrap.dedent('''
        from stoker.producer.pipeline import Field, Pipeline

        def make(size: int = 4, scale: float = 1.0, flip: bool = True, name: str = "x", mode: str = "train"):
            return Pipeline([Field("v", "float32", (size,))], sample=lambda r, g: {"v": [scale] * size},
                            name=f"{name}-{mode}-{flip}")

        NOT_A_PIPELINE = 3
    '''))
    made = load_pipeline(f"{source}:make", {"size": "3", "scale": "0.5", "flip": "no"}, {"mode": "eval", "image_size": 9})
    assert made.fields[0].shape == (3,) and made.name == "x-eval-False"
    errors = [
        (f"{source}:missing", {}, "has no 'missing'"),
        (f"{source}:NOT_A_PIPELINE", {}, "is a int, not a Pipeline"),
        (f"{tmp_path / 'nope.py'}:make", {}, "no file"),
        ("no_such_module_xyz:make", {}, "cannot import no_such_module_xyz"),
        ("justaname", {}, "expected one of imagenet, detection, segmentation"),
        (f"{source}:make", {"size": "big"}, "size=big: .* expects int"),
        (f"{source}:make", {"colour": "red"}, "--pipeline-arg colour: .* takes size, scale, flip, name, mode"),
        ("imagenet", {"size": "tiny"}, "expected N or HxW"),
    ]
    for ref, args, message in errors:
        with pytest.raises(PipelineError, match=message):
            load_pipeline(ref, args)


def test_the_record_rng_depends_on_seed_epoch_and_index_only():
    a, b = RecordRng(5), RecordRng(5)
    first = a.for_record(0, 17).random(4)
    a.for_record(3, 2).random(100)  # other records in between change nothing
    assert np.array_equal(b.for_record(0, 17).random(4), first)
    assert np.array_equal(a.for_record(0, 17).random(4), first)
    others = [a.for_record(0, 18).random(4), a.for_record(1, 17).random(4), RecordRng(6).for_record(0, 17).random(4)]
    assert not any(np.allclose(o, first) for o in others)
