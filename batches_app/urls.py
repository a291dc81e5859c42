from rest_framework.routers import SimpleRouter

from batches_app.views import BatchViewSet

router = SimpleRouter(trailing_slash=False)
router.register("v1/batches", BatchViewSet, basename="batch")
urlpatterns = router.urls
